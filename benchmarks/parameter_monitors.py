"""ParameterStats beside the usual parameter monitors, on a GPT-2-small-sized model.

The model: 12 pre-norm transformer blocks of width 768 (12 heads, MLP 3072), a vocabulary of
8,192 tied with the output layer, context 128: about 91 M parameters in 148 tensors, trained with
AdamW (foreach) on random tokens, batch 4. Variants, one training step each, interleaved in rounds
(`timing.py`):

1. no monitoring;
2. `ParameterStats` fused: weights, gradients and updates, every extra and a 64-bin histogram,
   every step;
3. the same with backend="python";
4. `wandb.watch(model, log="all", log_freq=1)` itself, in an offline run (`wandb.init(mode=
   "offline")`, written under a temporary folder), with the loss logged each step by `wandb.log`
   as a training loop does: its hooks clone every parameter (in a forward hook on the model) and
   every gradient (in a hook on each parameter), drop non-finite values, take the extremes with
   `.item()` and a 64-bin `histc` between them, and the step's `wandb.log` sends the histograms
   to wandb's writer process. It trains a copy of the model with an AdamW of its own (wandb's
   hooks stay on the model they watch);
5. Composer's `OptimizerMonitor` with `DecoupledAdamW`'s per-parameter metrics, reproduced: at the
   end of each batch, per parameter, the update Adam's moments give (bias-corrected, with the
   decoupled weight decay) and the L2 norms of the first moment, the parameter, the second moment
   (its square root), that update and the gradient, then the global gradient norm, every value
   turned into a Python float for the logger. Composer's `DecoupledAdamW` also reports two cosine
   similarities, left out here (a lower bound again);
6. Lightning's `grad_norm(model, norm_type=2)` (the real function), its values read as floats
   as `log_dict` does;
7. `torch._foreach_norm` over the same tensors as ParameterStats reads, in the same step hooks:
   the gradients and the weights before the step (a snapshot copied then, as ParameterStats
   keeps for the update), the weights after it and the update (`_foreach_sub_` of the two, in
   place into the snapshot): the norm alone, a one-read-per-kind bound.

The variants share one model and one AdamW state (each variant that hooks the optimizer steps an
AdamW of its own over the same parameters and state). The time each monitor spends in its own
work is measured inside the step too (ParameterStats' and `_foreach_norm`'s step hooks timed by
hooks registered around them). Then the statistics alone, in short rounds that a shared machine's
bursts disturb less: per kind, the step hooks of a ParameterStats recording that kind, fused,
against those of `_foreach_norm` over the same tensors, around an optimizer step that only
applies a saved AdamW update; and one step's worth of each other monitor's work on the same
parameters, gradients and AdamW state (wandb's: its own `log_tensor_stats` on every parameter and
gradient, then the step's `wandb.log`). Writes results.md and results.json to --out.

    python benchmarks/parameter_monitors.py [--rounds 5] [--stat-rounds 12] [--calls 2]
        [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import grad_norm
from timing import interleaved, machine_line, markdown_table, report
from torch import nn

from fasthooks import ParameterStats
from fasthooks.layout import EXTRAS

KINDS = ("weight", "grad", "update")
HIST_BINS = 64
EVERY_STAT = {"extra": EXTRAS, "hist_bins": HIST_BINS}
FULL = {"vocab": 8192, "context": 128, "width": 768, "layers": 12, "heads": 12, "batch": 4}
QUICK = {"vocab": 256, "context": 16, "width": 64, "layers": 2, "heads": 2, "batch": 2}
BARE = "no monitoring"
FUSED = "ParameterStats fused, every stat + 64-bin hist"
PYTHON = "ParameterStats python, every stat + 64-bin hist"
WANDB = "wandb.watch, offline"
COMPOSER = "Composer OptimizerMonitor (reproduced)"
LIGHTNING = "Lightning grad_norm"
FOREACH = "torch._foreach_norm, 3 kinds"
ALL = "all three"


class Block(nn.Module):
    """A GPT-2 block: causal self-attention and a 4x MLP, each after a LayerNorm."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        return self.ln(self.blocks(x)) @ self.tok.weight.T  # the output layer tied, as GPT-2's


class Clock:
    """Seconds spent in one monitor's own work, summed over a round's steps."""

    def __init__(self) -> None:
        self.total, self.samples, self._start = 0.0, [], 0.0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.total += time.perf_counter() - self._start

    def around_step_hooks(self, optimizer: torch.optim.Optimizer, register: Callable) -> None:
        """Time the step hooks that `register()` adds to `optimizer` (hooks run in order)."""
        optimizer.register_step_pre_hook(lambda *a: self.__enter__())
        optimizer.register_step_post_hook(lambda *a: self.__enter__())
        register()
        optimizer.register_step_pre_hook(lambda *a: self.__exit__())
        optimizer.register_step_post_hook(lambda *a: self.__exit__())

    def time(self, work: Callable[[], object]) -> None:
        with self:
            work()

    def close_round(self, calls: int) -> None:
        self.samples.append(self.total / calls)
        self.total = 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


# The monitors -------------------------------------------------------------------------------


class WandbWatch:
    """`wandb.watch(model, log="all", log_freq=1)` on `model`, in an offline run under `folder`;
    the time in its tensor statistics (`log_tensor_stats`, called by its hooks) and in each
    step's `wandb.log` goes to `clock`."""

    def __init__(self, model: nn.Module, folder: str, clock: Clock) -> None:
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb, self.clock = wandb, clock
        self.run = wandb.init(mode="offline", dir=folder, project="parameter-monitors")
        wandb.watch(model, log="all", log_freq=1)
        history = self.run._torch  # what wandb.watch's hooks call, timed
        work = history.log_tensor_stats
        history.log_tensor_stats = lambda tensor, name: clock.time(lambda: work(tensor, name))
        self.tensor_stats = work

    def commit(self, loss: float) -> None:
        """The training loop's `wandb.log` of the step, which sends the hooks' histograms."""
        with self.clock:
            self.wandb.log({"loss": loss})

    def one_step(self, model: nn.Module) -> None:
        """A step's worth of its work on `model` as it is: every parameter's and gradient's
        statistics, then the step's log."""
        for name, p in model.named_parameters():
            self.tensor_stats(p.data, f"parameters/{name}")
            self.tensor_stats(p.grad.data, f"gradients/{name}")
        self.wandb.log({"loss": 0.0})

    def finish(self) -> None:
        self.run.finish()


def composer_optimizer_monitor(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Composer's `OptimizerMonitor.batch_end` with `DecoupledAdamW.report_per_parameter_metrics`
    (reproduced; the two cosine similarities left out)."""
    group = optimizer.param_groups[0]
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    decay_factor = lr / group.get("initial_lr", lr)
    metrics: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if p.grad is None or not p.requires_grad:
            continue
        if p in optimizer.state:
            state = optimizer.state[p]
            step = state["step"].item()
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(eps)
            update = (lr / (1 - beta1**step)) * state["exp_avg"].div(denom)
            update.add_(p, alpha=-weight_decay * decay_factor)
            metrics[f"l2_norm/moment/{name}"] = torch.linalg.vector_norm(state["exp_avg"])
            metrics[f"l2_norm/param/{name}"] = torch.linalg.vector_norm(p.data)
            second = torch.linalg.vector_norm(state["exp_avg_sq"]).sqrt()
            metrics[f"l2_norm/second_moment_sqrt/{name}"] = second
            metrics[f"l2_norm/update/{name}"] = torch.linalg.vector_norm(update)
            metrics[f"l2_norm/grad/{name}"] = torch.linalg.vector_norm(p.grad)
        if f"l2_norm/grad/{name}" not in metrics:
            metrics[f"l2_norm/grad/{name}"] = torch.linalg.vector_norm(p.grad)
    norm = sum(v**2 for k, v in metrics.items() if k.startswith("l2_norm/grad"))
    metrics["l2_norm/grad/global"] = norm**0.5
    return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def lightning_grad_norm(model: nn.Module) -> dict[str, float]:
    return {k: float(v) for k, v in grad_norm(model, norm_type=2).items()}


class ForeachNorms:
    """`torch._foreach_norm` of the chosen kinds in the optimizer's step hooks, over what
    ParameterStats reads: the gradients and the weights before the step (copied into a snapshot
    for the update), the weights after it and the update (the snapshot minus the weights, in
    place into the snapshot: no allocation, and the update's norm)."""

    def __init__(self, params: list[nn.Parameter], kinds: tuple[str, ...]) -> None:
        self.weights = [p.detach() for p in params]
        self.params, self.kinds, self.norms = params, kinds, {}
        self.snapshots = [w.clone() for w in self.weights] if "update" in kinds else []

    def register(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._before)
        optimizer.register_step_post_hook(self._after)

    @torch.no_grad()
    def _before(self, *args: object) -> None:
        if "grad" in self.kinds:
            self.norms["grad"] = torch._foreach_norm([p.grad for p in self.params])
        if "update" in self.kinds:
            torch._foreach_copy_(self.snapshots, self.weights)
            self.norms["before"] = torch._foreach_norm(self.weights)

    @torch.no_grad()
    def _after(self, *args: object) -> None:
        if "weight" in self.kinds:
            self.norms["weight"] = torch._foreach_norm(self.weights)
        if "update" in self.kinds:  # in place: the snapshot is taken again before each step
            torch._foreach_sub_(self.snapshots, self.weights)
            self.norms["update"] = torch._foreach_norm(self.snapshots)


# The runs -----------------------------------------------------------------------------------


class Training:
    """The model, its AdamW state and its random batches, shared by every variant."""

    def __init__(self, size: dict[str, int]) -> None:
        torch.manual_seed(0)
        self.model = GPT(*(size[k] for k in ("vocab", "context", "width", "layers", "heads")))
        self.params = list(self.model.parameters())
        self.optimizer = self.adamw()
        self.state = self.optimizer.state
        tokens = torch.randint(0, size["vocab"], (4, size["batch"], size["context"] + 1))
        self.batches, self.steps = list(tokens), 0

    def adamw(self) -> torch.optim.AdamW:
        """An AdamW over the model's parameters; after the first, on the first's state."""
        optimizer = torch.optim.AdamW(self.params, lr=3e-4, weight_decay=0.1, foreach=True)
        if hasattr(self, "state"):
            optimizer.state = self.state
        return optimizer

    def backward(self, model: nn.Module | None = None) -> float:
        tokens = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        logits = (model or self.model)(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach()

    def step(self, optimizer: torch.optim.Optimizer, before=None, after=None, model=None) -> None:
        loss = self.backward(model)
        if before is not None:
            before()
        optimizer.step()
        if after is not None:
            after(loss)
        optimizer.zero_grad()


def training_variants(run: Training, expected_steps: int, watch: Callable) -> tuple[dict, dict]:
    """Each variant's training step, and the clocks of those that monitor."""
    steps: dict[str, Callable[[], None]] = {BARE: lambda: run.step(run.optimizer)}
    clocks = {name: Clock() for name in (FUSED, PYTHON, WANDB, COMPOSER, LIGHTNING, FOREACH)}
    for name, backend in ((FUSED, "fused"), (PYTHON, "python")):
        optimizer = run.adamw()
        ps = ParameterStats(
            run.model, optimizer, backend=backend, expected_steps=expected_steps, **EVERY_STAT
        )
        clocks[name].around_step_hooks(optimizer, ps.start)
        steps[name] = lambda o=optimizer: run.step(o)
    watched = copy.deepcopy(run.model)
    wandb = watch(watched, clocks[WANDB])
    own = torch.optim.AdamW(watched.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)
    steps[WANDB] = lambda: run.step(
        own, after=lambda loss: wandb.commit(float(loss)), model=watched
    )

    def composer(loss: object) -> None:
        with clocks[COMPOSER]:
            composer_optimizer_monitor(run.model, run.optimizer)

    def lightning() -> None:
        with clocks[LIGHTNING]:
            lightning_grad_norm(run.model)

    steps[COMPOSER] = lambda: run.step(run.optimizer, after=composer)
    steps[LIGHTNING] = lambda: run.step(run.optimizer, before=lightning)
    optimizer = run.adamw()
    foreach = ForeachNorms(run.params, KINDS)
    clocks[FOREACH].around_step_hooks(optimizer, lambda: foreach.register(optimizer))
    steps[FOREACH] = lambda: run.step(optimizer)
    return steps, clocks


class ApplyUpdate(torch.optim.Optimizer):
    """A step that adds a saved update to the parameters and takes it back the next time: real
    updates for the hooks around it, at the cost of one foreach add (outside the timed hooks)."""

    def __init__(self, params: list[nn.Parameter], update: list[torch.Tensor], sign: list) -> None:
        super().__init__(params, {})
        self.update, self.sign = update, sign  # the sign is shared by every such optimizer

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        torch._foreach_add_(self.param_groups[0]["params"], self.update, alpha=self.sign[0])
        self.sign[0] = -self.sign[0]


def statistics_variants(run: Training, expected_steps: int, wandb: WandbWatch) -> tuple[dict, dict]:
    """Per kind (and all three), ParameterStats fused and `_foreach_norm` in the step hooks of an
    optimizer that only applies a saved AdamW update; and a step's worth of each other monitor's
    work, called as such. The gradients stay from one backward, the AdamW state from its step."""
    before = [p.detach().clone() for p in run.params]
    run.step(run.optimizer)
    update = [p.detach() - b for p, b in zip(run.params, before, strict=True)]
    del before
    run.backward()
    sign = [1.0]
    steps, clocks = {}, {}
    for kinds in (*((k,) for k in KINDS), KINDS):
        label = kinds[0] if len(kinds) == 1 else ALL
        fused = ApplyUpdate(run.params, update, sign)
        ps = ParameterStats(
            run.model, fused, of=kinds, expected_steps=expected_steps, backend="fused", **EVERY_STAT
        )
        reference = ApplyUpdate(run.params, update, sign)
        norms = ForeachNorms(run.params, kinds)
        for name, optimizer, register in (
            (f"{label}: ParameterStats", fused, ps.start),
            (f"{label}: _foreach_norm", reference, lambda o=reference, n=norms: n.register(o)),
        ):
            clocks[name] = Clock()
            clocks[name].around_step_hooks(optimizer, register)
            steps[name] = optimizer.step
    for name, work in (
        (WANDB, lambda: wandb.one_step(run.model)),
        (COMPOSER, lambda: composer_optimizer_monitor(run.model, run.optimizer)),
        (LIGHTNING, lambda: lightning_grad_norm(run.model)),
    ):
        clocks[name] = Clock()
        steps[name] = lambda clock=clocks[name], work=work: clock.time(work)
    return steps, clocks


def timed(steps: dict, clocks: dict, rounds: int, calls: int, what: str) -> dict[str, float]:
    """Interleaved rounds; each variant's median seconds per call (its clock's samples are
    taken per round)."""
    start = time.perf_counter()
    for step in steps.values():  # the warm-up, then the clocks start from zero
        step()
    for clock in clocks.values():
        clock.total = 0.0

    def close_round() -> None:
        for clock in clocks.values():
            clock.close_round(calls)
        done = len(next(iter(clocks.values())).samples)
        elapsed = time.perf_counter() - start
        print(f"{what}: round {done}/{rounds}, {elapsed:.0f} s", file=sys.stderr, flush=True)

    timings = interleaved(steps, rounds=rounds, calls=calls, warmup=0, on_round=close_round)
    return {name: t.median for name, t in timings.items()}


# The report ---------------------------------------------------------------------------------


def larger_batch(run: Training, batch: int, rounds: int, expected_steps: int) -> dict[str, float]:
    """The bare step and ParameterStats fused's (its hooks timed) at `batch` sequences a step:
    the statistics cost the same whatever the batch, the step grows with it."""
    context = run.batches[0].shape[1]
    vocab = run.model.tok.weight.shape[0]
    run.batches = list(torch.randint(0, vocab, (2, batch, context)))
    optimizer = run.adamw()
    ps = ParameterStats(
        run.model, optimizer, backend="fused", expected_steps=expected_steps, **EVERY_STAT
    )
    clock = Clock()
    clock.around_step_hooks(optimizer, ps.start)
    steps = {BARE: lambda: run.step(run.optimizer), FUSED: lambda: run.step(optimizer)}
    step_s = timed(steps, {FUSED: clock}, rounds, 1, f"training steps, batch {batch}")
    return {"bare": step_s[BARE], "fused": step_s[FUSED], "hooks": clock.median}


def goal_lines(
    step_s: dict, in_step: dict, alone: dict, large: dict, batches: tuple[int, int]
) -> list[str]:
    """The goals, checked on the figures measured alone (in the training steps in brackets)."""
    ratios = {
        k: alone[f"{k}: ParameterStats"] / alone[f"{k}: _foreach_norm"] for k in (*KINDS, ALL)
    }
    fused = alone[f"{ALL}: ParameterStats"]
    wandb, composer = alone[WANDB] / fused, alone[COMPOSER] / fused
    share, large_share = fused / step_s[BARE], fused / large["bare"]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    each = ", ".join(f"{k} {r:.2f}x" for k, r in ratios.items())
    return [
        f"- ParameterStats fused, every statistic of a kind, over `_foreach_norm` of the same "
        f"tensors: {each} (goal <= 1.5x): {met(max(ratios.values()) <= 1.5)}",
        f"- wandb.watch, offline, over ParameterStats fused: {wandb:.1f}x (in the "
        f"steps {in_step[WANDB] / in_step[FUSED]:.1f}x) (goal >= 10x): {met(wandb >= 10)}",
        f"- Composer OptimizerMonitor's work (reproduced) over ParameterStats fused's: "
        f"{composer:.1f}x (in the steps {in_step[COMPOSER] / in_step[FUSED]:.1f}x) "
        f"(goal >= 3x): {met(composer >= 3)}",
        f"- ParameterStats fused at every=1, batch {batches[0]}: {100 * share:.1f}% of the bare "
        f"step (its hooks in the steps {100 * in_step[FUSED] / step_s[BARE]:.1f}%, step time "
        f"{100 * (step_s[FUSED] / step_s[BARE] - 1):+.1f}%) (goal < 2%): {met(share < 0.02)}",
        f"- ParameterStats fused at every=1, batch {batches[1]}: {100 * large_share:.1f}% of the "
        f"bare step (its hooks in the steps {100 * large['hooks'] / large['bare']:.1f}%, step "
        f"time {100 * (large['fused'] / large['bare'] - 1):+.1f}%) (goal < 2%): "
        f"{met(large_share < 0.02)}",
    ]


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of training steps")
    parser.add_argument("--stat-rounds", type=int, default=12, help="rounds of statistics alone")
    parser.add_argument("--calls", type=int, default=2, help="statistics calls per round")
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 steps, 1 round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.stat_rounds, args.calls = 1, 1, 2
    steps_per_round = 2 if args.quick else 1
    size = QUICK if args.quick else FULL
    run = Training(size)
    count = sum(p.numel() for p in run.params)
    if not args.quick and count < 50e6:
        raise SystemExit(f"the model has {count:,} parameters, fewer than 50 M")
    model = (
        f"GPT-2-style, {size['layers']} layers, width {size['width']}, vocabulary "
        f"{size['vocab']}, context {size['context']}, batch {size['batch']}: {count:,} "
        f"parameters in {len(run.params)} tensors, AdamW"
    )
    print(model, flush=True)

    with tempfile.TemporaryDirectory() as folder:
        watches: list[WandbWatch] = []

        def watch(model: nn.Module, clock: Clock) -> WandbWatch:
            watches.append(WandbWatch(model, folder, clock))
            return watches[-1]

        steps, clocks = training_variants(run, args.rounds * steps_per_round + 2, watch)
        step_s = timed(steps, clocks, args.rounds, steps_per_round, "training steps")
        in_step = {name: c.median for name, c in clocks.items()}
        del steps, clocks
        steps, clocks = statistics_variants(run, args.stat_rounds * args.calls + 2, watches[0])
        timed(steps, clocks, args.stat_rounds, args.calls, "statistics alone")
        alone = {name: c.median for name, c in clocks.items()}
        watches[0].finish()
    del steps, clocks
    large = larger_batch(run, 4 * size["batch"], args.rounds, args.rounds + 2)

    base = step_s[BARE]
    step_table = markdown_table(
        ["variant", "ms per step", "over no monitoring", "monitor ms per step", "of the bare step"],
        [
            [name, ms(s), f"{s / base:.3f}"]
            + (["-", "-"] if name == BARE else [ms(in_step[name]), f"{in_step[name] / base:.1%}"])
            for name, s in step_s.items()
        ],
    )
    kind_table = markdown_table(
        ["kind", "ParameterStats fused ms", "_foreach_norm ms", "ratio"],
        [
            [kind, ms(fused), ms(norm), f"{fused / norm:.2f}"]
            for kind in (*KINDS, ALL)
            for fused, norm in [(alone[f"{kind}: ParameterStats"], alone[f"{kind}: _foreach_norm"])]
        ],
    )
    fused = alone[f"{ALL}: ParameterStats"]
    alone_rows = {
        FUSED: fused,
        FOREACH: alone[f"{ALL}: _foreach_norm"],
        **{name: alone[name] for name in (WANDB, COMPOSER, LIGHTNING)},
    }
    monitor_table = markdown_table(
        ["monitor, one step's work alone", "ms", "over ParameterStats fused"],
        [[name, ms(s), f"{s / fused:.2f}"] for name, s in alone_rows.items()],
    )
    goals = goal_lines(step_s, in_step, alone, large, (size["batch"], 4 * size["batch"]))
    text = (
        f"{machine_line()}\n\n{model}.\n\nTraining steps, {args.rounds} round(s) of "
        f"{steps_per_round} step(s) per variant, medians; monitor ms: the time inside each "
        f"monitor's own work per step.\n\n{step_table}\n\nAt {4 * size['batch']} sequences a "
        f"step ({args.rounds} round(s), medians): no monitoring {ms(large['bare'])} ms, "
        f"ParameterStats fused {ms(large['fused'])} ms, its hooks {ms(large['hooks'])} ms."
        f"\n\nThe statistics alone, "
        f"{args.stat_rounds} round(s) of {args.calls} call(s), medians: per kind, the step hooks "
        f"of ParameterStats fused (every extra and a {HIST_BINS}-bin histogram) and of "
        f"`_foreach_norm` over the same tensors; then one step's worth of each monitor's work."
        f"\n\n{kind_table}\n\n{monitor_table}\n\nGoals:\n\n" + "\n".join(goals) + "\n"
    )
    report(text, args.out)
    if args.out is not None:
        results = {
            "quick": args.quick,
            "model": model,
            "parameters": count,
            "rounds": args.rounds,
            "stat_rounds": args.stat_rounds,
            "step_s": step_s,
            "monitor_in_step_s": in_step,
            "alone_s": alone,
            "larger_batch_s": large,
            "goals": goals,
        }
        (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
