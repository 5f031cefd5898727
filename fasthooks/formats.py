"""Will it fit: how values would fare cast to a low-precision float format, read from their
binade counts (the "binades" extra) and their largest magnitude, with no pass over the values.

For a format with smallest subnormal 2^s, smallest normal 2^emin and largest finite value `max`
(in binade emax), a value of binade e (|v| in [2^e, 2^(e + 1))) scaled by 2^k lands in binade
e + k, exactly. Of all the values (zeros and non-finite ones included):

- `underflow`: below the smallest subnormal (e + k < s). A cast makes them 0 or the smallest
  subnormal; it makes 0 at least those below half of it (e + k < s - 1).
- `subnormal`: from the smallest subnormal up to the smallest normal (s <= e + k < emin), where
  the format keeps fewer digits.
- `saturate`: above `max`. Those in the binades above emax always; those of binade emax
  (fp8_e4m3's 256 to 512, whose values above 448 saturate) only when the scaled largest magnitude
  is above `max`, and then all of them: an upper bound, exact where none of them is at most
  `max`. With "amax" scaling nothing saturates.
- `dynamic_range`: binades from the lowest non-zero value's to the largest's, both counted.

Values below 2^-126 (float32's subnormals) share one bin: they count as underflow where the
scaled format's smallest subnormal is above them, else as subnormal (bf16 unscaled: some of them
flush). float64 values of 2^128 or more count as saturating unless scaled below emax.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layout import BINADE_ABOVE, BINADE_BELOW, BINADE_FIRST, BINADE_MAX, BINADE_MIN


class FloatFormat(NamedTuple):
    """A float format's range: the exponents of its smallest normal and of its top binade, its
    mantissa bits and its largest finite value."""

    min_normal_exponent: int
    mantissa_bits: int
    max_exponent: int
    max_value: float

    @property
    def min_subnormal_exponent(self) -> int:
        return self.min_normal_exponent - self.mantissa_bits


FORMATS = {
    "fp8_e4m3": FloatFormat(-6, 3, 8, 448.0),  # torch.float8_e4m3fn
    "fp8_e5m2": FloatFormat(-14, 2, 15, 57344.0),  # torch.float8_e5m2
    "fp16": FloatFormat(-14, 10, 15, 65504.0),
    "bf16": FloatFormat(-126, 7, 127, float(torch.finfo(torch.bfloat16).max)),
}
SCALINGS = ("none", "amax")


class FormatFit(NamedTuple):
    """Per module per batch (float32 `(modules, batches)`): the fractions of the values that
    would underflow, land in subnormals or saturate, their dynamic range in binades, and the
    power-of-two exponent k of the scale 2^k applied (int64)."""

    underflow: torch.Tensor
    subnormal: torch.Tensor
    saturate: torch.Tensor
    dynamic_range: torch.Tensor
    scale_exponent: torch.Tensor


def check_format(fmt: str) -> FloatFormat:
    if fmt not in FORMATS:
        raise ValueError(f"fmt: unknown format {fmt!r}; known ones are {tuple(FORMATS)}")
    return FORMATS[fmt]


def scale_exponents(absmax: torch.Tensor, fmt: FloatFormat, scaling: str | int) -> torch.Tensor:
    """k of the scale 2^k for each slot: 0 with "none", the given int, or with "amax" the largest
    k that keeps the largest magnitude within the format (`max_value / absmax` rounded down to a
    power of two, as MX formats and Transformer Engine's power-of-two option scale); 0 where a
    slot has no finite non-zero largest magnitude.

    Examples:
        >>> amax = torch.tensor([1.0, 448.0, 1000.0])
        >>> scale_exponents(amax, FORMATS["fp8_e4m3"], "amax").tolist()
        [8, 0, -2]
    """
    if isinstance(scaling, bool) or not isinstance(scaling, (str, int)):
        raise TypeError(f"scaling must be 'none', 'amax' or an int, got {type(scaling).__name__}")
    if isinstance(scaling, int):
        return torch.full(absmax.shape, scaling, dtype=torch.int64)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be 'none', 'amax' or an int, got {scaling!r}")
    if scaling == "none":
        return torch.zeros(absmax.shape, dtype=torch.int64)
    amax = absmax.double()
    usable = amax.isfinite() & (amax > 0)
    k = torch.floor(torch.log2(fmt.max_value / torch.where(usable, amax, 1.0)))
    # log2 may round across an integer: the exact test is that amax * 2^k stays within max.
    k = torch.where(torch.ldexp(amax, k) > fmt.max_value, k - 1, k)
    k = torch.where(torch.ldexp(amax, k + 1) <= fmt.max_value, k + 1, k)
    return torch.where(usable, k, 0.0).long()


def format_fit(
    binades: torch.Tensor, absmax: torch.Tensor, fmt: str, scaling: str | int = "amax"
) -> FormatFit:
    """How values would fare cast to `fmt` ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16") scaled by
    `scaling` ("none"; "amax": per-tensor, by the largest power of two that keeps the largest
    magnitude finite; an int k: by 2^k), from their binade counts `(..., BINADE_BINS)` and their
    largest magnitude `(...)` (the module docstring says what each fraction counts).

    A per-tensor scale that is no power of two (Transformer Engine's default, `max / amax`) lies
    between the "amax" scale 2^k and 2^(k + 1): its underflow and subnormal fractions lie
    between those of k + 1 (`scaling=k + 1`) and those of k.

    Examples:
        >>> from fasthooks.moments import binade_counts
        >>> x = torch.tensor([1e-4, 0.5, 2.0, 300.0])
        >>> fit = format_fit(binade_counts(x), x.abs().amax(), "fp8_e4m3", scaling="none")
        >>> fit.underflow.item(), fit.subnormal.item(), fit.saturate.item()
        (0.25, 0.0, 0.0)
        >>> int(fit.dynamic_range)
        23
    """
    spec = check_format(fmt)
    counts = binades.double()
    total = counts.sum(-1)  # zeros and non-finite values count here only
    k = scale_exponents(absmax, spec, scaling)
    exponents = torch.arange(BINADE_MIN, BINADE_MAX + 1, dtype=torch.int64)
    scaled = exponents + k.unsqueeze(-1)  # each binade's exponent after scaling
    normal = counts[..., BINADE_FIRST : BINADE_FIRST + exponents.numel()]
    s, emin, emax = spec.min_subnormal_exponent, spec.min_normal_exponent, spec.max_exponent
    scaled_absmax = torch.ldexp(absmax.double(), k.double())
    over_top = (scaled_absmax > spec.max_value).unsqueeze(-1)
    below = counts[..., BINADE_BELOW]
    below_scaled = BINADE_MIN + k  # the "below" bin's values lie under 2^below_scaled
    underflow = (normal * (scaled < s)).sum(-1) + torch.where(below_scaled <= s, below, 0.0)
    subnormal = (normal * ((scaled >= s) & (scaled < emin))).sum(-1)
    subnormal = subnormal + torch.where(below_scaled > s, below, 0.0)
    top = (scaled > emax) | ((scaled == emax) & over_top)
    above = counts[..., BINADE_ABOVE]
    saturate = (normal * top).sum(-1) + torch.where(BINADE_MAX + 1 + k > emax, above, 0.0)
    occupied = counts[..., BINADE_BELOW : BINADE_ABOVE + 1] > 0
    positions = torch.arange(occupied.shape[-1], dtype=torch.float64)
    highest = torch.where(occupied, positions, -math.inf).amax(-1)
    lowest = torch.where(occupied, positions, math.inf).amin(-1)
    spread = torch.where(occupied.any(-1), highest - lowest + 1, math.nan)

    def fraction(part: torch.Tensor) -> torch.Tensor:
        return torch.where(total > 0, part / total.clamp(min=1), math.nan).float()

    return FormatFit(
        fraction(underflow), fraction(subnormal), fraction(saturate), spread.float(), k
    )
