"""Per-channel statistics on a GPT-2-small-sized model (transformers' GPT2LMHeadModel, random
weights): the memory the running sums take, measured from the buffers after a batch, beside what
one `(modules, planes, widest)` buffer would take; and a training step's time with no recorder,
with `ActivationStats()` and with every channel statistic on, side by side in one run.

    python benchmarks/channel_memory.py [--tokens 64] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from timing import interleaved, machine_line, markdown_table, report

from fasthooks import ActivationStats
from fasthooks.layout import CHANNEL_PLANES, CHANNEL_STATS

STEPS = 4  # training steps per timed run


def gpt2_small() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config())  # 12 layers, 768 wide, 50,257 tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = gpt2_small()
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens))

    def step() -> None:
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    plain = ActivationStats(model)
    channels = ActivationStats(model, channel_stats=CHANNEL_STATS)
    with channels:
        step()
        channels.on_batch_end()
        snapshots = channels._snapshots
        running = channels._buffers.channels.numel() * 8 + snapshots.period.numel() * 8
        used = snapshots.used
        counts = channels.channel_counts
    padded = 2 * len(counts) * len(CHANNEL_PLANES) * max(counts) * 8

    def steps(act: ActivationStats | None):
        """STEPS training steps, in one run of `act` (its set-up shared by them)."""

        def run() -> None:
            if act is None:
                for _ in range(STEPS):
                    step()
                return
            with act:
                for _ in range(STEPS):
                    step()
                    act.on_batch_end()

        return run

    timings = interleaved(
        {
            "no recorder": steps(None),
            "ActivationStats()": steps(plain),
            "ActivationStats(channel_stats=all four)": steps(channels),
        },
        rounds=args.rounds,
        calls=1,
    )
    floor = timings["no recorder"].median
    rows = [
        [name, f"{t.median * 1e3:.1f}", f"{t.median / floor:.3f}"] for name, t in timings.items()
    ]
    memory = {
        "modules": len(counts),
        "channels": sum(counts),
        "room used": used,
        "running sums, device bytes (batch and period)": running,
        "one snapshot, host bytes": used * len(CHANNEL_PLANES) * 8,
        "padded (modules, planes, widest) layout, bytes (batch and period)": padded,
    }
    text = (
        f"{machine_line()}; GPT-2 small (random weights), {args.tokens} tokens, one batch\n\n"
        + markdown_table(["", "value"], [[k, f"{v:,}"] for k, v in memory.items()])
        + f"\n\n{STEPS} training steps (forward and backward) in one run, median of "
        f"{args.rounds} rounds\n\n"
        + markdown_table(["variant", "ms", "x no recorder"], rows)
        + "\n"
    )
    report(text, args.out)
    if args.out is not None:
        (args.out / "results.json").write_text(json.dumps(memory, indent=2))


if __name__ == "__main__":
    main()
