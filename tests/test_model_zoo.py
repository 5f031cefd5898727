"""Real architectures from timm and transformers, with random weights: a few training steps with
every statistic and a histogram, forward and gradient, against a float64 reference computed by
plain torch hooks from the same outputs in a run of the same model without fasthooks."""

from __future__ import annotations

import copy
import math
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from conftest import BACKENDS
from torch import nn

from fasthooks import ActivationStats

EXTRA = ("min", "max", "near_zero", "nonfinite", "kurtosis")
HIST = {"hist_bins": 16, "hist_range": (-3.0, 3.0)}
STEPS, BATCH = 2, 4


def _library(name: str):
    """timm needs torchvision, which installs beside torch 2.14.1 only (make test-wheel runs
    this there, with FASTHOOKS_REQUIRE_MODEL_ZOO=1)."""
    if os.environ.get("FASTHOOKS_REQUIRE_MODEL_ZOO") == "1":
        return __import__(name)
    return pytest.importorskip(name)


def _timm(name: str, **kwargs: Any) -> Callable[[], tuple[nn.Module, Callable]]:
    def make():
        timm = _library("timm")
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        images = torch.randn(STEPS, BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        labels = torch.arange(STEPS * BATCH).reshape(STEPS, BATCH) % 10

        def loss(model, step, channels_last=False):
            x = images[step]
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            return nn.functional.cross_entropy(model(x).float(), labels[step])

        return model, loss

    return make


# Small configs without dropout (two runs of a model must compute the same values):
# (config class, model class, settings).
TRANSFORMERS = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        {
            "n_layer": 2,
            "n_embd": 32,
            "n_head": 2,
            "n_positions": 64,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
        },
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
        },
    ),
}
VOCAB = 97


def _transformers(kind: str) -> Callable[[], tuple[nn.Module, Callable]]:
    def make():
        transformers = _library("transformers")
        config, model_class, settings = TRANSFORMERS[kind]
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(
            getattr(transformers, config)(vocab_size=VOCAB, **settings)
        )
        generator = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (STEPS, BATCH, 12), generator=generator)

        def loss(model, step, channels_last=False):
            return model(input_ids=tokens[step], labels=tokens[step]).loss

        return model, loss

    return make


MODELS = {
    "timm resnet18": _timm("resnet18"),
    "timm convnext_atto": _timm("convnext_atto"),
    "timm vit_tiny": _timm("vit_tiny_patch16_224", img_size=32, patch_size=8),
    "timm efficientnet_b0": _timm("efficientnet_b0"),
    "gpt2": _transformers("gpt2"),
    "llama": _transformers("llama"),
    "bert": _transformers("bert"),
}
# (model, variant): what each library offers beyond a plain fp32 step.
CASES = [(name, "plain") for name in MODELS] + [
    ("timm resnet18", "channels_last"),
    ("timm resnet18", "bf16_autocast"),
    ("timm resnet18", "checkpointing"),
    ("timm efficientnet_b0", "checkpointing"),
    ("gpt2", "bf16_autocast"),
    ("gpt2", "checkpointing"),
    ("llama", "checkpointing"),
    ("bert", "checkpointing"),
    ("bert", "compiled"),
]


def _first_float(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    items = output.values() if isinstance(output, Mapping) else output
    if isinstance(output, (tuple, list, Mapping)):
        for item in items:
            found = _first_float(item)
            if found is not None:
                return found
    return None


def _reference(model: nn.Module, modules: list[nn.Module], loss: Callable, variant: str):
    """Per direction, (module, step): the float64 values of every call's tensor."""
    seen = {d: defaultdict(list) for d in ("forward", "gradient")}
    step = [0]

    def forward_hook(index, o):
        t = _first_float(o)
        if t is None:
            return
        key = (index, step[0])
        seen["forward"][key].append(t.detach().double().reshape(-1).clone())
        if t.requires_grad:
            t.register_hook(lambda g: seen["gradient"][key].append(g.double().reshape(-1).clone()))

    handles = [
        m.register_forward_hook(lambda m, i, o, index=index: forward_hook(index, o))
        for index, m in enumerate(modules)
    ]
    _train(model, loss, variant, lambda: step.__setitem__(0, step[0] + 1))
    for h in handles:
        h.remove()
    return seen


def _train(model: nn.Module, loss: Callable, variant: str, end_step: Callable[[], None]):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model.train()
    for step in range(STEPS):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "bf16_autocast")
        with autocast:
            value = loss(model, step, channels_last=variant == "channels_last")
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end_step()


def _exact_histogram(v: torch.Tensor) -> torch.Tensor:
    """Counts against the float64 edges: e_k <= v < e_k+1, the top edge in the last bin."""
    bins, (lo, hi) = HIST["hist_bins"], HIST["hist_range"]
    edges = lo + (hi - lo) * torch.arange(bins + 1, dtype=torch.float64) / bins
    inside = v[(v >= lo) & (v <= hi)]
    return torch.bincount(torch.bucketize(inside, edges[1:-1], right=True), minlength=bins)


def _expected(values: list[torch.Tensor]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "std": math.nan, "count": 0}
    v = torch.cat(values)
    d = v - v.mean()
    m2 = (d**2).mean()
    return {
        "mean": v.mean().item(),
        "std": v.std().item() if v.numel() > 1 else math.nan,
        "min": v.min().item(),
        "max": v.max().item(),
        "near_zero": (v.float() <= 0.05).double().mean().item(),
        "nonfinite": int((~v.isfinite()).sum()),
        "kurtosis": ((d**4).mean() / m2**2).item() if m2 > 0 else math.nan,
        "hist": _exact_histogram(v),
        "count": v.numel(),
    }


def _close(got: float, want: float, rel: float, scale: float = 0.0) -> bool:
    if math.isnan(want):
        return math.isnan(got)
    return abs(got - want) <= rel * (abs(want) + scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("name", "variant"), CASES, ids=[f"{n}-{v}" for n, v in CASES])
def test_real_models_record_what_plain_hooks_see(name, variant, backend):
    model, loss = MODELS[name]()
    if variant == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    reference_model = copy.deepcopy(model)
    recordings = {}
    for direction in ("forward", "gradient"):
        measured = copy.deepcopy(model)
        if variant == "checkpointing" and hasattr(measured, "set_grad_checkpointing"):
            measured.set_grad_checkpointing()
        elif variant == "checkpointing":
            measured.gradient_checkpointing_enable({"use_reentrant": False})
        if variant == "compiled":
            measured = torch.compile(measured, backend="aot_eager")
        act = ActivationStats(
            measured, backend=backend, extra=EXTRA, is_forward=direction == "forward", **HIST
        )
        with act:
            _train(measured, loss, variant, act.on_batch_end)
        recordings[direction] = act
    act = recordings["forward"]
    if name == "timm efficientnet_b0":  # its norm-and-activation layers hold their own weights
        assert sum(type(m).__name__ == "BatchNormAct2d" for m in act.modules) == 49
    modules = [dict(reference_model.named_modules())[n] for n in act.module_names]
    reference = _reference(reference_model, modules, loss, variant)
    # Compiled graphs and autocast round differently from eager float32 arithmetic.
    rel = 1e-3 if variant == "compiled" else 1e-4
    for direction, act in recordings.items():
        assert act.num_batches == STEPS
        stats, extra, hist = act.stats, act.extra, act.hist
        recorded = 0
        for index, module_name in enumerate(act.module_names):
            for step in range(STEPS):
                want = _expected(reference[direction][index, step])
                where = f"{direction} {module_name} step {step}"
                mean, std = stats[:, index, step].tolist()
                if want["count"] == 0:
                    assert math.isnan(mean) and hist[index, step].sum() == 0, where
                    continue
                recorded += 1
                assert _close(mean, want["mean"], rel, want["std"]), (where, mean, want)
                assert _close(std, want["std"], rel), (where, std, want)
                assert extra["nonfinite"][index, step].item() == want["nonfinite"], where
                for stat in ("min", "max"):
                    assert _close(extra[stat][index, step].item(), want[stat], 1e-6), where
                assert _close(extra["near_zero"][index, step].item(), want["near_zero"], rel), where
                assert _close(extra["kurtosis"][index, step].item(), want["kurtosis"], 10 * rel), (
                    where
                )
                # Values on a bin edge may round to the next bin between two runs' arithmetic.
                moved = (hist[index, step] - want["hist"]).abs().sum().item()
                assert moved <= (2 if variant == "compiled" else 0), (where, moved)
        assert recorded >= len(act.module_names), direction
