"""The reading API every recording shares: a live `ActivationStats`, one kind of a
`ParameterStats` (`ps["grad"]`) and a `Recording` loaded from a sink all read alike, so summary,
export, pictures and the non-finite report work on each of them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .arguments import module_position
from .formats import FormatFit, format_fit
from .layout import STATS_PLANES, TOP_CHANNEL, TOP_VALUE

if TYPE_CHECKING:
    from .column_store import ColumnStore


class Reading:
    """What reading needs from a recording (`stats`, `extra`, `hist`, `batches`, `num_batches`,
    `module_names`, `module_types`, `call_order`, `nonfinite_ranks`, `kind`, `recorder`,
    `is_forward`, `extra_names`, `hist_bins`, `hist_min`, `hist_max`, with `top_k > 0` `top`,
    and with `channel_names` the readers of `ChannelReading`), and all it derives."""

    top_k = 0
    channel_names: tuple[str, ...] = ()

    @property
    def top_values(self) -> torch.Tensor:
        """`(rows, batches, top_k)` float64 CPU: the values of largest magnitude, signed, the
        largest first (of equal magnitude the positive one, then the lower channel); NaN where a
        slot held fewer values that were not NaN. Only with `top_k > 0`."""
        return self.top[..., TOP_VALUE]

    @property
    def top_channels(self) -> torch.Tensor:
        """`(rows, batches, top_k)` int64 CPU: the channel of each of `top_values` along the
        module's `channel_dim`; -1 where there is no value."""
        channels = self.top[..., TOP_CHANNEL]
        return torch.where(channels.isnan(), -1.0, channels).long()

    @property
    def metric_prefix(self) -> str:
        """The first part of a metric's tag: "activations", "gradients" or
        "parameters/<kind>"."""
        if self.recorder == "ParameterStats":
            return f"parameters/{self.kind}"
        return "activations" if self.is_forward else "gradients"

    def module_index(self, module: int | str) -> int:
        """The row of a module (or parameter), given its qualified name or an index."""
        return module_position(self.module_names, module)

    def layer_stats(self, module: int | str) -> dict[str, torch.Tensor]:
        """Every recorded statistic of one row, by index or qualified name: `(batches,)` CPU
        tensors "mean", "std" and each extra.

        Examples:
            >>> from torch import nn
            >>> from fasthooks import ActivationStats
            >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            >>> with ActivationStats(model, backend="python", extra=["max"]) as act:
            ...     _ = model(torch.randn(8, 4))
            ...     act.on_batch_end()
            >>> sorted(act.layer_stats("2"))
            ['max', 'mean', 'std']
        """
        index = self.module_index(module)
        return {name: values[index] for name, values in self.planes().items()}

    def planes(self) -> dict[str, torch.Tensor]:
        """Every recorded statistic as a `(rows, batches)` CPU tensor, by name: "mean", "std",
        each extra, with the "binades" extra the low-precision fit of `FIT_PLANES`, and with
        `top_k > 0` the largest value of `TOP_PLANES` (the table, the pictures, TensorBoard and
        the summary read these)."""
        stats = self.stats
        planes = {name: stats[i] for i, name in enumerate(STATS_PLANES)}
        planes.update(self.extra)
        if "binades" in self.extra_names:
            planes.update(fit_planes(self))
        if self.top_k:
            planes.update(top_planes(self, planes))
        return planes

    def format_fit(self, fmt: str, scaling: str | int = "amax") -> FormatFit:
        """How each row's values of each batch would fare cast to the low-precision format `fmt`
        ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16") scaled by `scaling` ("amax": per tensor, by the
        largest power of two that keeps its largest magnitude finite; "none"; an int k: by
        2^k), from the binades and the largest magnitude with no pass over the values: the
        fractions that would underflow, land in subnormals or saturate, and the dynamic range
        (`fasthooks.formats` says exactly what each counts). Needs the "binades" extra.

        Examples:
            >>> from torch import nn
            >>> from fasthooks import ActivationStats
            >>> model = nn.Sequential(nn.Linear(8, 8))
            >>> with ActivationStats(model, backend="python", extra=["binades"]) as act:
            ...     _ = model(torch.randn(4, 8))
            ...     act.on_batch_end()
            >>> fit = act.format_fit("fp8_e4m3", scaling="none")
            >>> tuple(fit.underflow.shape), float(fit.saturate[0, 0])
            ((1, 1), 0.0)
        """
        return format_fit(self.binades, self._largest_magnitude(), fmt, scaling)

    def _largest_magnitude(self) -> torch.Tensor:
        """`(rows, batches)` float32: each slot's largest magnitude."""
        extra = self.extra
        if "absmax" in extra:
            return extra["absmax"]
        return torch.maximum(extra["min"].abs(), extra["max"].abs())

    def first_nonfinite(self) -> Any:
        """The first recorded call whose values held a NaN or an infinity, or None: a
        `NonFinite(batch, module, direction, count, rank)`, the earliest batch and in it the
        module called first. After `all_reduce`, the earliest over every rank, naming the rank.
        `fasthooks.first_nonfinite(forward, backward)` compares several runs.

        Examples:
            >>> from torch import nn
            >>> from fasthooks import ActivationStats
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
            >>> with ActivationStats(model, backend="python", extra=["nonfinite"]) as act:
            ...     for x in (1.0, float("nan")):
            ...         _ = model(torch.full((3, 2), x))
            ...         act.on_batch_end()
            >>> act.first_nonfinite()
            NonFinite(batch=1, module='0', direction='forward', count=6, rank=None)
        """
        from .nonfinite import first_nonfinite

        return first_nonfinite(self)

    def summary(self, top: int = 10, window: int = 10) -> Any:
        """The `top` rows that look worst, most severe first, each with what was found and the
        batch where it began: non-finite values; dead units (near-zero fraction at least 0.99,
        or no spread, over the last `window` batches); std exploding or collapsing (10x against
        the row's own first batches); kurtosis spikes; with `top_k > 0`, massive activations (a
        largest magnitude at least 100x the row's RMS over the last `window` batches, with the
        channels it was in); with the "binades" extra, values that
        would underflow in fp8 (at least 1% below the smallest subnormal of fp8_e4m3, or of
        fp8_e5m2 for gradients, with amax scaling); with `channel_stats`, dead channels (of an
        output: none of a channel's values above `near_zero` over the newest snapshot, named)
        and outlier features (the kurtosis over the channels of their RMS at least 30 in the
        newest snapshot). A `Summary`: printable as a table, `.to_dataframe()` for pandas,
        iterable over its `Finding`s."""
        from .summary import summarize

        return summarize(self, top, window)

    def to_dataframe(self) -> Any:
        """Every recorded statistic as a pandas DataFrame in long format (needs pandas)."""
        from .export import long_table

        return long_table(self)

    def plot(self, path: str | Path | None = None) -> Any:
        """A heat map per statistic over rows and batches (a `matplotlib.figure.Figure`, also
        saved as a PNG at `path` when given); readable from 3 to 300 rows."""
        from .plot import overview

        return overview(self, path)

    def plot_layer_stats(self, module: int | str, path: str | Path | None = None) -> Any:
        """Mean, std and near-zero fraction of one row over the batches, as a Figure."""
        from .plot import layer_stats

        return layer_stats(self, module, path)

    def color_dim(self, module: int | str, path: str | Path | None = None) -> Any:
        """One row's histogram over the batches as an image on a log scale, as a Figure;
        needs `hist_bins > 0`."""
        from .plot import color_dim

        return color_dim(self, module, path)

    def log_to_tensorboard(self, writer: Any, step: int | None = None) -> None:
        """Write the newest recorded column of every statistic (and histogram) to the
        `torch.utils.tensorboard.SummaryWriter` given, tagged `<metric_prefix>/<name>/<stat>`;
        `step` defaults to that column's batch."""
        from .export import log_to_tensorboard

        log_to_tensorboard(self, writer, step)


# What the "binades" extra adds to every reading's statistics: the dynamic range in binades, and
# the fractions that would underflow in FP8 with per-tensor amax scaling (to a power of two),
# fp8_e4m3 as forward activations are cast and fp8_e5m2 as gradients are.
FIT_PLANES = ("dynamic_range", "fp8_e4m3_underflow", "fp8_e5m2_underflow")


def fit_planes(reading: Reading) -> dict[str, torch.Tensor]:
    """`FIT_PLANES` of a reading that recorded binades."""
    e4m3, e5m2 = (reading.format_fit(fmt, scaling="amax") for fmt in ("fp8_e4m3", "fp8_e5m2"))
    return {
        "dynamic_range": e4m3.dynamic_range,
        "fp8_e4m3_underflow": e4m3.underflow,
        "fp8_e5m2_underflow": e5m2.underflow,
    }


# What `top_k` adds to every reading's statistics: the value of largest magnitude, its channel,
# and its magnitude over the root mean square of all values, sqrt(mean^2 + std^2) (a massive
# activation stands 100 times above it, or more).
TOP_PLANES = ("top_value", "top_channel", "top_to_rms")


def top_planes(reading: Reading, planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`TOP_PLANES` of a reading that recorded top values, beside its mean and std `planes`."""
    value = reading.top_values[..., 0].float()
    rms = (planes["mean"].square() + planes["std"].square()).sqrt()
    return {
        "top_value": value,
        "top_channel": reading.top_channels[..., 0],
        "top_to_rms": value.abs() / rms,
    }


def stepped_call_order(nonfinite: torch.Tensor) -> torch.Tensor:
    """The call order of a ParameterStats kind, from its non-finite counts `(rows, steps)`: its
    operator keeps none, since a step's parameters are measured in one call in row order, so a
    row whose values held a NaN or an infinity is noted at its row's place with its count.

    Examples:
        >>> stepped_call_order(torch.tensor([[0, 0], [0, 3]])).tolist()
        [[[0, 0], [0, 2]], [[0, 0], [0, 3]]]
    """
    hit = nonfinite > 0
    rows = torch.arange(1, nonfinite.shape[0] + 1).unsqueeze(1).expand_as(nonfinite)
    return torch.stack([torch.where(hit, rows, 0), torch.where(hit, nonfinite, 0)])


class KindReading(Reading):
    """One kind of a `ParameterStats` run ("weight", "grad", "update") with the reading API of
    `ActivationStats`: rows are parameters, columns optimizer steps.

    Examples:
        >>> from torch import nn
        >>> from fasthooks import ParameterStats
        >>> model = nn.Sequential(nn.Linear(4, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with ParameterStats(model, opt, backend="python") as ps:
        ...     model(torch.randn(8, 4)).sum().backward()
        ...     opt.step()
        >>> ps["grad"].layer_stats("0.bias")["norm"].shape
        torch.Size([1])
    """

    recorder = "ParameterStats"
    is_forward = True

    def __init__(self, store: ColumnStore, kind: str, settings: dict[str, Any]) -> None:
        self._store, self.kind = store, kind
        self.nonfinite_ranks: dict[tuple[int, str], int] = {}
        self.module_names = list(settings["names"])
        self.module_types = list(settings["types"])
        self.extra_names = tuple(settings["extra"])
        self.hist_bins = settings["hist_bins"]
        self.hist_min, self.hist_max = settings["hist_range"]

    @property
    def num_batches(self) -> int:
        return self._store.num_batches

    @property
    def batches(self) -> torch.Tensor:
        return self._store.batches

    @property
    def stats(self) -> torch.Tensor:
        return self._store.read(self.kind, "stats")

    @property
    def extra(self) -> dict[str, torch.Tensor]:
        return self._store.extra(self.kind, self.extra_names)

    @property
    def hist(self) -> torch.Tensor:
        if not self.hist_bins:
            raise AttributeError("hist is recorded only with hist_bins > 0")
        return self._store.read(self.kind, "hist")

    @property
    def call_order(self) -> torch.Tensor:
        """`stepped_call_order` of this kind's non-finite counts."""
        return stepped_call_order(self._store.read(self.kind, "nonfinite"))
