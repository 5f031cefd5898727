"""The reference statistics: per-slot moments merged with tensor ops, and their read-out.

The state of a statistics run is one float64 tensor of shape `(3, modules, batches)`
holding, for every (module, batch) slot, the element count, the mean and the sum of
squared deviations (M2). Slots are merged with Chan's parallel formula, so a module that
runs several times in a batch ends with the moments of all its calls. Everything here is
a tensor op on the state's device: nothing waits for the device.
"""

from __future__ import annotations

import torch

COUNT, MEAN, M2 = 0, 1, 2


def new_state(num_modules: int, capacity: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An empty `(3, num_modules, capacity)` float64 moment state on `device`.

    Example:
        >>> new_state(4, 16).shape
        torch.Size([3, 4, 16])
    """
    return torch.zeros(3, num_modules, capacity, dtype=torch.float64, device=device)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype accumulates in float32."""
    if not dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got dtype {dtype}")
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate_moments_python(
    x: torch.Tensor, state: torch.Tensor, cursor: torch.Tensor, slot: int
) -> None:
    """Merge the moments of all of `x` into `state[:, slot, cursor]`, in place, with tensor ops.

    Example:
        >>> state, cursor = new_state(1, 2), torch.tensor(0)
        >>> accumulate_moments_python(torch.tensor([1.0, 3.0]), state, cursor, 0)
        >>> state[:, 0, 0].tolist()
        [2.0, 2.0, 2.0]
    """
    if x.device != state.device:
        raise ValueError(f"x is on {x.device} but the statistics state is on {state.device}")
    x = x.detach()
    n_b = x.numel()
    if n_b == 0:
        return
    x = x.to(accumulation_dtype(x.dtype))
    # torch.mean rather than var_mean's Welford mean, which turns an infinite mean into NaN.
    mean_b = x.mean().double()
    m2_b = x.var(correction=0).double() * n_b
    column = cursor.reshape(1)
    slot_state = state[:, slot]
    n_a, mean_a, m2_a = slot_state.index_select(1, column).unbind(0)
    n = n_a + n_b
    delta = mean_b - mean_a
    merged = torch.stack(
        (
            n,
            (n_a * mean_a + n_b * mean_b) / n,
            m2_a + m2_b + delta * delta * (n_a * n_b / n),
        )
    )
    slot_state.index_copy_(1, column, merged)


def clear_column(state: torch.Tensor, cursor: torch.Tensor) -> None:
    """Forget every module's moments at the cursor's column."""
    state.index_fill_(2, cursor.reshape(1), 0.0)


def state_to_stats(state: torch.Tensor) -> torch.Tensor:
    """The `(2, modules, batches)` float32 mean and unbiased std of a moment state.

    A slot with no element reads NaN/NaN; one element reads its value and NaN std, as
    `torch.std` does.

    Example:
        >>> state = new_state(1, 1)
        >>> accumulate_moments_python(torch.tensor([1.0, 3.0]), state, torch.tensor(0), 0)
        >>> state_to_stats(state)[:, 0, 0].tolist()
        [2.0, 1.4142135381698608]
    """
    count, mean, m2 = state.unbind(0)
    nan = torch.full_like(mean, float("nan"))
    mean = torch.where(count > 0, mean, nan)
    std = torch.where(count > 1, (m2 / (count - 1)).sqrt(), nan)
    return torch.stack((mean, std)).float()
