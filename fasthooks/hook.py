"""Module hooks with a clear lifetime: `Hook`, `Hooks`, `hook_output(s)` and `HookCallback`."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from .outputs import tensors_in

HookFunc = Callable[[nn.Module, Any, Any], Any]


def _detach(value: Any) -> Any:
    """Detach tensors, also inside (nested) tuples and lists, keeping the container type."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_detach(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def _check_module(m: Any, name: str) -> nn.Module:
    if not isinstance(m, nn.Module):
        raise TypeError(f"{name} must be a torch.nn.Module, got {type(m).__name__}")
    if isinstance(m, torch.jit.ScriptModule):
        raise TypeError(
            f"{name} is a TorchScript module ({type(m).__name__}), which takes no Python hooks: "
            "hook the eager module before scripting it, or use torch.compile instead"
        )
    return m


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's input or output (containers too) that autograd will reach."""
    return [t for t in tensors_in(value) if t.requires_grad]


class _BackwardCall:
    """One call of a module on the way back: its gradients, gathered from hooks on its input
    and output tensors, handed to `done(grad_input, grad_output)` once both are complete."""

    def __init__(self, inputs: tuple[Any, ...], done: Callable[[Any, Any], None]) -> None:
        self.done, self.arity, self.grad_output = done, len(inputs), None
        self.watched = [
            i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if self.watched:  # registered before the module runs: an in-place op inside it is fine
            tensors = [inputs[i] for i in self.watched]
            torch.autograd.graph.register_multi_grad_hook(tensors, self._inputs_ready)

    def watch_outputs(self, output: Any) -> None:
        outputs = _grad_tensors(output)
        if outputs:  # registered before any later in-place op: the gradients are theirs
            torch.autograd.graph.register_multi_grad_hook(outputs, self._outputs_ready)

    def _outputs_ready(self, grads: Any) -> None:
        self.grad_output = tuple(grads)
        if not self.watched:
            self.done((None,) * self.arity, self.grad_output)

    def _inputs_ready(self, grads: Any) -> None:
        grad_input: list[Any] = [None] * self.arity
        for position, grad in zip(self.watched, grads, strict=True):
            grad_input[position] = grad
        self.done(tuple(grad_input), self.grad_output)


class Hook:
    """A forward (or backward) hook on one module; the hook function's result is `.stored`.

    Args:
        m: the module to hook (not a TorchScript module).
        hook_func: called as `hook_func(module, input, output)`, or for a backward hook as
            `hook_func(module, grad_input, grad_output)`, as in fastai v1.
        is_forward: a forward hook (default) or a backward hook.
        detach: detach the tensors hook_func sees (default True), inside containers too.

    A backward hook is called once for each call of the module whose outputs get a gradient,
    once the gradients of its inputs are complete too. `grad_output` is a tuple with the
    gradient of each output tensor (None for one that got none); `grad_input` a tuple with one
    entry per positional input: the gradient autograd computed for that tensor (for an input
    that other modules read too, the sum over all of them), None where it needs none. It is
    built from hooks on the tensors, so an in-place op after the module, or inside it
    (`nn.ReLU(inplace=True)`), is fine, where a module's full backward hook fails.

    Examples:
        >>> lin = nn.Linear(3, 2)
        >>> with Hook(lin, lambda m, i, o: o.shape) as h:
        ...     _ = lin(torch.zeros(4, 3))
        >>> h.stored
        torch.Size([4, 2])
    """

    def __init__(
        self, m: nn.Module, hook_func: HookFunc, is_forward: bool = True, detach: bool = True
    ) -> None:
        _check_module(m, "m")
        if not callable(hook_func):
            raise TypeError(f"hook_func must be callable, got {type(hook_func).__name__}")
        self.hook_func, self.detach, self.is_forward = hook_func, detach, is_forward
        self.stored: Any = None
        if is_forward:
            self._handles = [m.register_forward_hook(self._hook_fn)]
        else:
            self._calls: list[_BackwardCall] = []  # open calls of the module, innermost last
            self._handles = [
                m.register_forward_pre_hook(self._backward_call_begins),
                m.register_forward_hook(self._backward_call_ends),
            ]
        self.removed = False

    def _hook_fn(self, module: nn.Module, input: Any, output: Any) -> None:
        if self.detach:
            input, output = _detach(input), _detach(output)
        self.stored = self.hook_func(module, input, output)

    def _backward_call_begins(self, module: nn.Module, input: Any) -> None:
        done = functools.partial(self._hook_fn, module)
        self._calls.append(_BackwardCall(input, done) if torch.is_grad_enabled() else None)

    def _backward_call_ends(self, module: nn.Module, input: Any, output: Any) -> None:
        call = self._calls.pop() if self._calls else None
        if call is not None and not self.removed:
            call.watch_outputs(output)

    def remove(self) -> None:
        """Deregister the hook; calling it again does nothing."""
        if not self.removed:
            for handle in self._handles:
                handle.remove()
            self.removed = True

    def __enter__(self) -> Hook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Hooks:
    """One `Hook` per module of `ms`, removed as a group; `.stored` lists results in module order.

    Args:
        ms: the modules (any iterable, a `Sequential` among them); if one cannot be hooked,
            none stays hooked.
        hook_func: called for each module, as for `Hook`.
        is_forward: forward hooks (True) or backward hooks, as for `Hook`.
        detach: detach what the hook function receives, as for `Hook`.

    Examples:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with Hooks(model, lambda m, i, o: o.shape) as hooks:
        ...     _ = model(torch.zeros(5, 3))
        >>> hooks.stored
        [torch.Size([5, 4]), torch.Size([5, 4]), torch.Size([5, 2])]
    """

    def __init__(
        self,
        ms: Iterable[nn.Module],
        hook_func: HookFunc,
        is_forward: bool = True,
        detach: bool = True,
    ) -> None:
        modules = [_check_module(m, f"ms[{i}]") for i, m in enumerate(ms)]
        self.hooks: list[Hook] = []
        try:
            for m in modules:
                self.hooks.append(Hook(m, hook_func, is_forward, detach))
        except BaseException:
            self.remove()
            raise

    def __getitem__(self, i: int) -> Hook:
        return self.hooks[i]

    def __len__(self) -> int:
        return len(self.hooks)

    def __iter__(self) -> Iterator[Hook]:
        return iter(self.hooks)

    @property
    def stored(self) -> list[Any]:
        return [h.stored for h in self.hooks]

    def remove(self) -> None:
        """Deregister every hook; calling it again does nothing."""
        for h in self.hooks:
            h.remove()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _keep_output(m: nn.Module, i: Any, o: Any) -> Any:
    return o


def _keep_grad_output(m: nn.Module, grad_input: Any, grad_output: Any) -> Any:
    return grad_output


def hook_output(module: nn.Module, detach: bool = True, grad: bool = False) -> Hook:
    """Keep the output of `module` (or, with `grad=True`, the gradient of its output) in `.stored`.

    Examples:
        >>> lin = nn.Linear(3, 2)
        >>> with hook_output(lin) as h:
        ...     y = lin(torch.ones(1, 3))
        >>> torch.equal(h.stored, y)
        True
    """
    return Hook(module, _keep_grad_output if grad else _keep_output, not grad, detach)


def hook_outputs(modules: Iterable[nn.Module], detach: bool = True, grad: bool = False) -> Hooks:
    """`hook_output` for each of `modules`, as one `Hooks`.

    Examples:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        >>> with hook_outputs(model) as hooks:
        ...     _ = model(torch.ones(1, 3))
        >>> [o.shape for o in hooks.stored]
        [torch.Size([1, 4]), torch.Size([1, 2])]
    """
    return Hooks(modules, _keep_grad_output if grad else _keep_output, not grad, detach)


def modules_with_own_params(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that holds parameters of its own (not only through children), in
    the order of `model.modules()`: the leaf layers, and layers such as timm's norm-and-activation
    layers (`BatchNormAct2d`: a batch norm's parameters, and act and drop children). The model
    itself only when it is a leaf: its output is its last layer's.

    Examples:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> [type(m).__name__ for m in modules_with_own_params(model)]
        ['Linear', 'Linear']
    """
    return [
        m
        for m in model.modules()
        if any(_layer_parameter(p) for p in m.parameters(recurse=False))
        and (m is not model or not any(True for _ in m.children()))
    ]


def _layer_parameter(p: nn.Parameter) -> bool:
    # FSDP1 moves every parameter of a wrapped model into one flat parameter: no layer's own.
    return not getattr(p, "_is_flat_param", False)


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a `torch.compile` wrapper runs (itself for any other module): its hooks fire
    inside the compiled graph, and its `named_modules()` give the names users know.

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> unwrap_compiled(torch.compile(lin)) is lin
        True
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def _resolve_model(model: Any) -> nn.Module:
    if isinstance(model, nn.Module):
        return unwrap_compiled(model)
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module):
        return unwrap_compiled(inner)
    raise TypeError(
        f"model must be an nn.Module or have an nn.Module at .model, got {type(model).__name__}"
    )


class HookCallback:
    """Registers `self.hook(m, input, output)` on `modules` for the length of training.

    Subclasses define `hook`; it sees detached tensors unless the subclass sets
    `detach = False`. With `is_forward=False` it is a backward hook (see `Hook`):
    `hook(m, grad_input, grad_output)`. The lifecycle keeps fastai v1's names
    (`on_train_begin`, `on_batch_end`, `on_train_end`); in a plain loop use it as a context
    manager.

    Args:
        model: the `nn.Module` to watch, or any object with one at `.model` (a learner); a
            `torch.compile` wrapper stands for the module it compiled.
        modules: the modules to hook (a single module, or an iterable); default: every module
            with parameters of its own (`modules_with_own_params`), in `model.modules()` order.
        do_remove: remove the hooks at `on_train_end` (default True).
        is_forward: forward hooks (default) or backward hooks (see `Hook`).

    Examples:
        >>> class Shapes(HookCallback):
        ...     def hook(self, m, i, o):
        ...         return o.shape
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> with Shapes(model) as cb:
        ...     _ = model(torch.zeros(2, 3))
        ...     shapes = cb.hooks.stored
        >>> shapes
        [torch.Size([2, 4]), torch.Size([2, 2])]
    """

    detach = True

    def __init__(
        self,
        model: Any,
        modules: Iterable[nn.Module] | None = None,
        do_remove: bool = True,
        is_forward: bool = True,
    ) -> None:
        self.model = _resolve_model(model)
        for name, flag in (("do_remove", do_remove), ("is_forward", is_forward)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.is_forward = is_forward
        self.modules: list[nn.Module] | None = None
        if isinstance(modules, nn.Module) and not hasattr(type(modules), "__iter__"):
            modules = [modules]  # one module; a Sequential or ModuleList stands for its children
        if modules is not None:
            self.modules = [_check_module(m, f"modules[{i}]") for i, m in enumerate(modules)]
        self.do_remove = do_remove
        self.hooks: Hooks | None = None
        self._finalizer: weakref.finalize | None = None

    def hook(self, m: nn.Module, i: Any, o: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define hook(self, m, input, output)")

    def registers_forward(self) -> bool:
        """Forward hooks, or (with `is_forward=False`) backward hooks seeing gradients."""
        return self.is_forward

    def resolve_modules(self) -> list[nn.Module]:
        """The modules to hook, checked: those given, else `modules_with_own_params(model)`."""
        modules = self.modules if self.modules is not None else modules_with_own_params(self.model)
        self.modules = [_check_module(m, f"modules[{i}]") for i, m in enumerate(modules)]
        return self.modules

    def on_train_begin(self, **kwargs: Any) -> None:
        """Register the hooks (again, if an earlier run left some)."""
        self._remove_hooks()
        self.hooks = Hooks(
            self.resolve_modules(), _weak_hook(self), self.registers_forward(), self.detach
        )
        self._finalizer = weakref.finalize(self, self.hooks.remove)

    def on_batch_end(self, train: bool = True, **kwargs: Any) -> None:
        """Called after each batch; `train=False` marks a validation batch."""

    def on_train_end(self, **kwargs: Any) -> None:
        """Remove the hooks when `do_remove`."""
        if self.do_remove:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> HookCallback:
        self.on_train_begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.on_train_end()


def _weak_hook(callback: HookCallback) -> HookFunc:
    """A hook function that does not keep `callback` alive, so hooks never outlive it."""
    ref = weakref.ref(callback)

    def call(m: nn.Module, i: Any, o: Any) -> Any:
        cb = ref()
        return None if cb is None else cb.hook(m, i, o)

    return call
