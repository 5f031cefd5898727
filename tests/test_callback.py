import gc

import pytest
import torch
from torch import nn

from fasthooks import HookCallback


class RecordShapes(HookCallback):
    def hook(self, m, i, o):
        return tuple(o.shape)


class Learner:
    def __init__(self, model):
        self.model = model


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    )


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


def test_default_modules_are_leaves_with_parameters_in_order():
    model = _net()
    cb = RecordShapes(model)
    cb.on_train_begin()
    assert cb.modules == [model[0], model[1], model[4]]
    model(torch.randn(2, 1, 6, 6))
    assert cb.hooks.stored == [(2, 2, 4, 4), (2, 2, 4, 4), (2, 3)]
    cb.on_train_end()
    assert _hook_count(model) == 0


def test_accepts_learner_like_object_and_explicit_modules():
    model = _net()
    with RecordShapes(Learner(model), modules=[model[2]]) as cb:
        model(torch.randn(1, 1, 6, 6))
        assert cb.hooks.stored == [(1, 2, 4, 4)]
    assert _hook_count(model) == 0


def test_rejects_objects_without_a_model():
    with pytest.raises(
        TypeError, match=r"model must be an nn.Module or have an nn.Module at .model"
    ):
        RecordShapes(object())
    with pytest.raises(TypeError, match=r"modules\[0\] must be a torch.nn.Module"):
        RecordShapes(_net(), modules=["conv"])


def test_hooks_removed_when_training_loop_raises():
    model = _net()
    with pytest.raises(RuntimeError, match="loss exploded"), RecordShapes(model):
        model(torch.randn(1, 1, 6, 6))
        assert _hook_count(model) == 3
        raise RuntimeError("loss exploded")
    assert _hook_count(model) == 0


def test_do_remove_false_keeps_hooks_until_next_begin():
    model = _net()
    cb = RecordShapes(model, do_remove=False)
    cb.on_train_begin()
    cb.on_train_end()
    assert _hook_count(model) == 3
    cb.on_train_begin()
    assert _hook_count(model) == 3
    cb.hooks.remove()
    assert _hook_count(model) == 0


def test_hooks_do_not_outlive_callback():
    model = _net()
    cb = RecordShapes(model, do_remove=False)
    cb.on_train_begin()
    assert _hook_count(model) == 3
    del cb
    gc.collect()
    assert _hook_count(model) == 0
    model(torch.randn(1, 1, 6, 6))


def test_base_class_hook_must_be_defined():
    model = nn.Linear(2, 2)
    with (
        pytest.raises(NotImplementedError, match="HookCallback must define hook"),
        HookCallback(model),
    ):
        model(torch.randn(1, 2))


class NormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in miniature: a batch norm's own parameters, and an act child."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def test_default_modules_include_layers_with_parameters_and_children():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), NormAct(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    cb = RecordShapes(model)
    cb.on_train_begin()
    assert cb.modules == [model[0], model[1], model[3]]
    cb.on_train_end()
    assert RecordShapes(model[1]).resolve_modules() == []  # the model itself, not a leaf
    assert RecordShapes(nn.Linear(2, 2)).resolve_modules()[0].in_features == 2
