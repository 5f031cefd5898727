"""`ActivationStats.summary()`: the modules that look worst, from the statistics recorded."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .stats import ActivationStats

# What makes a module look bad, most severe first.
KINDS = (
    "non-finite",
    "dead",
    "dead channels",
    "std exploding",
    "std collapsing",
    "kurtosis spike",
    "massive activation",
    "outlier features",
    "would underflow in fp8",
)
DEAD_FRACTION = 0.99
# A std this many times above (or below) the module's own first batches.
STD_FACTOR = 10.0
# A kurtosis this many times its module's median, and at least SPIKE_FLOOR (3 is normal).
SPIKE_FACTOR = 10.0
SPIKE_FLOOR = 30.0
# With top_k: a largest magnitude this many times the module's root mean square over the last
# batches (Sun et al. 2024 see about 10^4 in large language models).
MASSIVE_FACTOR = 100.0
# With the "binades" extra: this fraction of a module's values (the median over the last batches)
# below the smallest subnormal of fp8_e4m3 (outputs) or fp8_e5m2 (gradients), amax-scaled.
UNDERFLOW_FRACTION = 0.01
# With channel_stats: the kurtosis over a module's channels of their RMS at least this (He et al.
# 2024's outlier-feature measure: 3 for normal RMS; one channel among n far above the others
# gives about n).
OUTLIER_KURTOSIS = 30.0
# Dead channels named in a finding's detail, at most.
NAMED_CHANNELS = 8


class Finding(NamedTuple):
    """One module's worst finding: `kind` (one of KINDS), the training batch where it began,
    what was seen, and the other kinds found in the same module."""

    module: str
    kind: str
    batch: int
    detail: str
    also: str


class Summary:
    """The findings of `ActivationStats.summary`, most severe first: a table when printed."""

    COLUMNS = ("module", "kind", "batch", "detail", "also")

    def __init__(self, findings: list[Finding], batches: int) -> None:
        self.findings = findings
        self.batches = batches

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __getitem__(self, index: int) -> Finding:
        return self.findings[index]

    def to_dataframe(self) -> Any:
        """The findings as a pandas DataFrame, one row each (needs pandas)."""
        import pandas as pd

        return pd.DataFrame(self.findings, columns=list(self.COLUMNS))

    def __str__(self) -> str:
        if not self.findings:
            return f"nothing found over {self.batches} recorded batches"
        rows = [("module", "found", "since batch", "detail", "also")]
        rows += [(f.module, f.kind, str(f.batch), f.detail, f.also) for f in self.findings]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        return "\n".join(line.rstrip() for line in lines)

    __repr__ = __str__


def _rank(kind: str) -> int:
    return KINDS.index(kind)


def _first(mask: torch.Tensor) -> int | None:
    hits = mask.nonzero()
    return int(hits[0]) if len(hits) else None


def _trailing_start(mask: torch.Tensor) -> int:
    """Where the run of True that ends `mask` begins (len(mask) when it ends with False)."""
    false = (~mask).nonzero()
    return int(false[-1]) + 1 if len(false) else 0


Found = tuple[tuple[float, ...], str, int, str]


def _nonfinite(order: torch.Tensor, mean: torch.Tensor) -> list[Found]:
    marked = (order[0] > 0) | mean.isinf()
    began = _first(marked)
    if began is None:
        return []
    detail = f"NaN or infinite values in {int(marked.sum())} of {len(mean)} batches"
    return [((_rank("non-finite"), began, float(order[0, began])), "non-finite", began, detail)]


def _dead(
    stats: dict[str, torch.Tensor], ran: torch.Tensor, window: int, forward: bool
) -> list[Found]:
    recent = ran.nonzero().flatten()[-window:]
    dead, what = stats["std"] == 0, "no spread (std 0)"
    # Gradients are small by nature: only an output's near-zero fraction tells of dead units.
    if forward and "near_zero" in stats:
        dead = dead | (stats["near_zero"] >= DEAD_FRACTION)
        what = f"near-zero fraction >= {DEAD_FRACTION} or no spread"
    if len(recent) == 0 or not bool(dead[recent].all()):
        return []
    began = _trailing_start(dead | ~ran)
    return [((_rank("dead"), began), "dead", began, f"{what} over the last {len(recent)} batches")]


def _std_drift(std: torch.Tensor, window: int) -> list[Found]:
    columns = (std.isfinite() & (std > 0)).nonzero().flatten()
    if len(columns) < 4:
        return []
    baseline = float(std[columns[: len(columns) // 4]].median())
    ratio = float(std[columns[-window:]].median()) / baseline
    if STD_FACTOR > ratio > 1 / STD_FACTOR:
        return []
    exploding = ratio >= STD_FACTOR
    crossed = std >= STD_FACTOR * baseline if exploding else std <= baseline / STD_FACTOR
    began = _first(crossed & std.isfinite())
    kind = "std exploding" if exploding else "std collapsing"
    detail = f"std {ratio:.3g}x that of its first batches ({baseline:.3g})"
    # Exploding and collapsing rank together, by how far the std moved.
    return [((_rank("std exploding"), -abs(math.log(ratio))), kind, began, detail)]


def _kurtosis_spikes(kurtosis: torch.Tensor) -> list[Found]:
    finite = kurtosis[kurtosis.isfinite()]
    if len(finite) == 0:
        return []
    median = float(finite.median())
    spikes = kurtosis > max(SPIKE_FACTOR * median, SPIKE_FLOOR)
    began = _first(spikes)
    if began is None:
        return []
    peak = float(kurtosis[spikes].max())
    spiked = f"{int(spikes.sum())} of {len(kurtosis)} batches"
    detail = f"kurtosis up to {peak:.3g} (median {median:.3g}) in {spiked}"
    return [((_rank("kurtosis spike"), -peak / median), "kurtosis spike", began, detail)]


def _fp8_underflow(stats: dict[str, torch.Tensor], window: int, forward: bool) -> list[Found]:
    fmt = "fp8_e4m3" if forward else "fp8_e5m2"
    underflow = stats.get(f"{fmt}_underflow")
    if underflow is None:
        return []
    seen = underflow.isfinite().nonzero().flatten()[-window:]
    if len(seen) == 0:
        return []
    typical = float(underflow[seen].median())
    if typical < UNDERFLOW_FRACTION:
        return []
    began = _first(underflow >= UNDERFLOW_FRACTION)
    spread = float(stats["dynamic_range"][seen].median())
    detail = (
        f"{typical:.1%} of values below {fmt}'s smallest subnormal with amax scaling (median of "
        f"the last {len(seen)} batches); dynamic range {spread:.0f} binades"
    )
    return [((_rank("would underflow in fp8"), -typical), "would underflow in fp8", began, detail)]


def _massive(stats: dict[str, torch.Tensor], window: int) -> list[Found]:
    ratio = stats.get("top_to_rms")
    if ratio is None:
        return []
    seen = ratio.isfinite().nonzero().flatten()[-window:]
    if len(seen) == 0:
        return []
    top = stats["top_value"][seen].abs().double()
    rms = math.sqrt(
        float((stats["mean"][seen].double() ** 2 + stats["std"][seen].double() ** 2).mean())
    )
    factor = float(top.max()) / rms
    if not factor >= MASSIVE_FACTOR:
        return []
    began = _first(ratio >= MASSIVE_FACTOR)
    channels = Counter(stats["top_channel"][seen].tolist()).most_common(3)
    on_top = ", ".join(f"channel {c} ({n} of {len(seen)} batches)" for c, n in channels)
    detail = (
        f"largest magnitude {float(top.max()):.3g}, {factor:.3g}x the RMS ({rms:.3g}) over the "
        f"last {len(seen)} batches; largest in {on_top}"
    )
    began = int(seen[0]) if began is None else began
    return [((_rank("massive activation"), -factor), "massive activation", began, detail)]


def module_findings(
    stats: dict[str, torch.Tensor], order: torch.Tensor, window: int, forward: bool = True
) -> list[Found]:
    """(sort key, kind, column where it began, detail) of everything found in one module's
    `(batches,)` statistics (of its outputs, else of their gradients) and its `(2, batches)`
    call order, most severe first."""
    ran = ~stats["mean"].isnan() | (order[0] > 0)
    found = _nonfinite(order, stats["mean"]) + _dead(stats, ran, window, forward)
    found += _std_drift(stats["std"], window)
    if "kurtosis" in stats:
        found += _kurtosis_spikes(stats["kurtosis"])
    found += _massive(stats, window) + _fp8_underflow(stats, window, forward)
    return sorted(found)


def _dead_channels(dead: torch.Tensor, counts: int, bounds: list[tuple[int, int]]) -> list[Found]:
    """Channels dead (`(channels, snapshots)`) over the newest snapshot, since the first of the
    snapshots over which they all were."""
    newest = dead[:counts, -1].nonzero().flatten()
    if len(newest) == 0:
        return []
    throughout = dead[newest].all(0)
    began = bounds[_trailing_start(throughout)][0]
    named = ", ".join(str(c) for c in newest[:NAMED_CHANNELS].tolist())
    more = f" and {len(newest) - NAMED_CHANNELS} more" if len(newest) > NAMED_CHANNELS else ""
    first, last = bounds[-1]
    detail = (
        f"{len(newest)} of {counts} channels with no value above near_zero over batches "
        f"{first}-{last}: channel {named}{more}"
    )
    return [((_rank("dead channels"), -len(newest) / counts), "dead channels", began, detail)]


def _outlier_features(kurtosis: torch.Tensor, bounds: list[tuple[int, int]]) -> list[Found]:
    """A channel-RMS kurtosis (`(snapshots,)`) of at least OUTLIER_KURTOSIS in the newest
    snapshot."""
    newest = float(kurtosis[-1]) if len(kurtosis) else math.nan
    if not newest >= OUTLIER_KURTOSIS:
        return []
    began = bounds[_first(kurtosis >= OUTLIER_KURTOSIS)][0]
    first, last = bounds[-1]
    detail = (
        f"kurtosis of the channels' RMS {newest:.3g} over batches {first}-{last} (3 when no "
        "channel stands out)"
    )
    return [((_rank("outlier features"), -newest), "outlier features", began, detail)]


def channel_findings(act: ActivationStats) -> list[list[Found]]:
    """Per row, what its per-channel snapshots show (nothing without `channel_stats`), with the
    training batch where it began."""
    rows = len(act.module_names)
    if not act.channel_names:
        return [[] for _ in range(rows)]
    bounds, counts = act.channel_batches.tolist(), act.channel_counts
    if not bounds:
        return [[] for _ in range(rows)]
    dead, kurtosis = act.dead_channels, act.channel_rms_kurtosis
    found = []
    for row in range(rows):
        mine = _outlier_features(kurtosis[row], bounds)
        # Gradients are small by nature: near_zero tells of dead units in outputs only.
        if act.is_forward and counts[row]:
            mine += _dead_channels(dead[row], counts[row], bounds)
        found.append(mine)
    return found


def summarize(act: ActivationStats, top: int, window: int) -> Summary:
    """The `top` worst modules of a run, each by its most severe finding."""
    from .arguments import count_argument

    top = count_argument(top, "top", 1)
    window = count_argument(window, "window", 1)
    names, order, batch_ids = act.module_names, act.call_order, act.batches.tolist()
    per_channel = channel_findings(act)
    ranked = []
    for index, name in enumerate(names):
        stats = act.layer_stats(index)
        found = [
            (key, kind, batch_ids[column], detail)
            for key, kind, column, detail in module_findings(
                stats, order[:, index], window, act.is_forward
            )
        ]
        found = sorted(found + per_channel[index])
        if not found:
            continue
        key, kind, batch, detail = found[0]
        also = ", ".join(dict.fromkeys(k for _, k, _, _ in found[1:] if k != kind))
        ranked.append((key, Finding(name, kind, batch, detail, also)))
    ranked.sort(key=lambda item: item[0])
    return Summary([finding for _, finding in ranked[:top]], act.num_batches)
