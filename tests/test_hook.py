from collections import namedtuple

import pytest
import torch
from torch import nn

from fasthooks import Hook, HookCallback, Hooks, hook_output, hook_outputs


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def test_forward_hook_stores_result_of_hook_func():
    lin = nn.Linear(4, 2)
    x = torch.randn(5, 4)
    with Hook(lin, lambda m, i, o: (m, i[0].sum(), o * 2)) as h:
        y = lin(x)
    module, input_sum, doubled = h.stored
    assert module is lin
    torch.testing.assert_close(input_sum, x.sum())
    torch.testing.assert_close(doubled, y.detach() * 2)
    assert not doubled.requires_grad


def test_detach_false_keeps_graph():
    lin = nn.Linear(4, 2)
    with Hook(lin, lambda m, i, o: o, detach=False) as h:
        lin(torch.randn(3, 4))
    assert h.stored.requires_grad and h.stored.grad_fn is not None


def test_detach_reaches_nested_containers_and_keeps_types():
    Pair = namedtuple("Pair", "a b")

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            y = self.lin(x)
            return (y, [y * 2, (y * 3, "tag")], Pair(y, 1))

    m = Nested()
    with Hook(m, lambda mod, i, o: o) as h:
        m(torch.randn(1, 2))
    out = h.stored
    assert type(out) is tuple and type(out[1]) is list and type(out[1][1]) is tuple
    assert type(out[2]) is Pair and out[2].b == 1 and out[1][1][1] == "tag"
    for t in (out[0], out[1][0], out[1][1][0], out[2].a):
        assert isinstance(t, torch.Tensor) and not t.requires_grad


def test_backward_hook_sees_real_gradients():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(6, 4, requires_grad=True)
    with Hook(lin, lambda m, gi, go: (gi, go), is_forward=False) as h:
        y = lin(x)
        (y**2).sum().backward()
    grad_input, grad_output = h.stored
    torch.testing.assert_close(grad_output[0], 2 * y.detach())
    torch.testing.assert_close(grad_input[0], x.grad)


def test_hook_output_grad_stores_output_gradient():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    with hook_output(lin, grad=True) as h:
        y = lin(x)
        (3 * y).sum().backward()
    torch.testing.assert_close(h.stored[0], torch.full_like(y, 3.0))


def test_remove_is_idempotent_and_reported():
    lin = nn.Linear(2, 2)
    h = Hook(lin, lambda m, i, o: o)
    assert not h.removed and len(lin._forward_hooks) == 1
    h.remove()
    h.remove()
    assert h.removed and len(lin._forward_hooks) == 0
    lin(torch.randn(1, 2))
    assert h.stored is None


def test_hook_rejects_bad_arguments():
    with pytest.raises(TypeError, match="m must be a torch.nn.Module, got str"):
        Hook("layer", lambda m, i, o: o)
    with pytest.raises(TypeError, match="hook_func must be callable, got int"):
        Hook(nn.Linear(1, 1), 3)


def test_hooks_collection_behaviour():
    model = _net()
    with Hooks(model, lambda m, i, o: o.shape) as hooks:
        assert len(hooks) == 3
        assert all(isinstance(h, Hook) for h in hooks)
        assert hooks[0] is next(iter(hooks))
        model(torch.randn(7, 4))
        assert hooks.stored == [torch.Size([7, 8]), torch.Size([7, 8]), torch.Size([7, 3])]
    assert all(h.removed for h in hooks)
    assert all(len(m._forward_hooks) == 0 for m in model)


def test_hooks_reports_position_of_non_module():
    with pytest.raises(TypeError, match=r"ms\[1\] must be a torch.nn.Module, got int"):
        Hooks([nn.ReLU(), 5], lambda m, i, o: o)


def test_hook_outputs_on_nested_model():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    model = nn.Sequential(inner, nn.Sequential(nn.Flatten(), nn.Linear(4 * 6 * 6, 5)))
    x = torch.randn(2, 3, 8, 8)
    with hook_outputs([inner[0], inner, model[1][1], model]) as hooks:
        y = model(x)
    conv_out = inner[0](x)
    torch.testing.assert_close(hooks.stored[0], conv_out)
    torch.testing.assert_close(hooks.stored[1], conv_out.relu())
    torch.testing.assert_close(hooks.stored[2], y)
    torch.testing.assert_close(hooks.stored[3], y)


def _inplace_net() -> nn.Sequential:
    """A ResNet's pattern: a layer followed by an in-place activation, and one hooked itself."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 3),
    )


def _reference_gradients(model: nn.Module, x: torch.Tensor) -> dict[int, tuple]:
    """(grad_input, grad_output) of each module from full backward hooks on an out-of-place
    copy of `model`, where those hooks work."""
    copy = nn.Sequential(*(nn.ReLU() if isinstance(m, nn.ReLU) else m for m in model))
    seen: dict[int, tuple] = {}
    handles = [
        m.register_full_backward_hook(lambda m, gi, go, i=i: seen.setdefault(i, (gi, go)) and None)
        for i, m in enumerate(copy)
    ]
    copy(x).pow(2).sum().backward()
    for h in handles:
        h.remove()
    return seen


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_backward_hooks_survive_in_place_ops_and_see_the_gradients():
    model, x = _inplace_net(), torch.randn(6, 4)
    want = _reference_gradients(model, x)
    backward = Hooks(model, lambda m, gi, go: (gi, go), is_forward=False)
    with backward as hooks, hook_outputs(model, grad=True) as grads:
        model(x).pow(2).sum().backward()
    for i, (grad_input, grad_output) in enumerate(hooks.stored):
        torch.testing.assert_close(grad_output[0], want[i][1][0])
        assert grads.stored[i][0] is not None
        torch.testing.assert_close(grads.stored[i][0], want[i][1][0])
        if i == 0:  # the data needs no gradient
            assert grad_input == (None,)
        else:  # the in-place ReLU's own input gradient is its output's, masked
            torch.testing.assert_close(grad_input[0], want[i][0][0])


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
def test_backward_hook_callback_on_a_layer_before_an_in_place_relu():
    class GradNorms(HookCallback):
        def hook(self, m, grad_input, grad_output):
            return grad_output[0].norm()

    model, x = _inplace_net(), torch.randn(6, 4)
    want = _reference_gradients(model, x)
    with GradNorms(model, is_forward=False) as cb:
        model(x).pow(2).sum().backward()
        norms = cb.hooks.stored
    assert cb.modules == [model[0], model[2], model[4]]
    expected = [want[i][1][0].norm() for i in (0, 2, 4)]
    torch.testing.assert_close(torch.stack(norms), torch.stack(expected))


def test_backward_hook_is_called_once_per_call_and_not_without_grad():
    lin, calls = nn.Linear(3, 3), []
    with Hook(lin, lambda m, gi, go: calls.append(go[0].shape), is_forward=False):
        with torch.no_grad():
            lin(torch.randn(2, 3))
        y = lin(lin(torch.randn(2, 3)))  # twice in one graph
        y.sum().backward()
    assert calls == [torch.Size([2, 3])] * 2
