"""fasthooks: fastai v1's hooks API for any PyTorch model, with fused activation statistics."""

from ._version import __version__
from .build_info import build_info
from .formats import FORMATS, FormatFit, format_fit
from .hook import (
    Hook,
    HookCallback,
    Hooks,
    hook_output,
    hook_outputs,
    modules_with_own_params,
    unwrap_compiled,
)
from .nonfinite import (
    NonFinite,
    NonFiniteError,
    NonFiniteReport,
    NonFiniteWarning,
    first_nonfinite,
)
from .ops import extension_available, extension_error
from .parameters import ParameterStats
from .plot import plot_stats
from .recording import Recording, load
from .sink import SinkChunk
from .sizes import (
    LayerInfo,
    dummy_batch,
    dummy_eval,
    in_channels,
    model_sizes,
    model_summary,
    num_features_model,
    params_size,
    total_params,
)
from .stats import ActivationStats, StatisticsError

__all__ = [
    "FORMATS",
    "ActivationStats",
    "FormatFit",
    "Hook",
    "HookCallback",
    "Hooks",
    "LayerInfo",
    "NonFinite",
    "NonFiniteError",
    "NonFiniteReport",
    "NonFiniteWarning",
    "ParameterStats",
    "Recording",
    "SinkChunk",
    "StatisticsError",
    "__version__",
    "build_info",
    "dummy_batch",
    "dummy_eval",
    "extension_available",
    "extension_error",
    "first_nonfinite",
    "format_fit",
    "hook_output",
    "hook_outputs",
    "in_channels",
    "load",
    "model_sizes",
    "model_summary",
    "modules_with_own_params",
    "num_features_model",
    "params_size",
    "plot_stats",
    "total_params",
    "unwrap_compiled",
]
