"""The training benchmark's --quick mode writes what it promises (structure, never timings)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FUSED, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
MODES = ("mean+std", "every extra", "every extra + hist")
VARIANTS = [
    "no hooks",
    "fastai v1 hook (reproduced)",
    "fastai v2 hook (reproduced)",
    "fasthooks python",
    "fasthooks fused",
    "fasthooks fused, every stat + 40-bin hist",
]


def _script_env() -> dict[str, str]:
    """For a child running a benchmark script, which imports its siblings: PYTHONSAFEPATH (set
    where the suite runs against an installed wheel) leaves a script's own folder off its path."""
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join((str(ROOT / "benchmarks"), env["PYTHONPATH"]))
    return env


@FUSED
@pytest.mark.slow
def test_quick_training_benchmark_writes_table_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    out = tmp_path / "bench"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "training_overhead.py"),
            "--quick",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_script_env(),
    )
    assert run.returncode == 0, run.stderr[-2000:]

    results = json.loads((out / "results.json").read_text())
    assert results["quick"] is True and results["variants"] == VARIANTS
    assert [m["model"].split(",")[0] for m in results["models"]] == [
        "ResNet-style CNN",
        "MLP 784-2048x3-10",
        "Transformer encoder",
    ]
    for model in results["models"]:
        assert model["hooked_modules"] > 0
        assert set(model["variants"]) == set(VARIANTS)
        for figures in model["variants"].values():
            samples = figures["samples_s"]
            assert len(samples) == results["rounds"] * model["steps_per_turn"]
            assert all(s > 0 for s in samples)
            assert figures["min_s"] <= figures["median_s"] <= figures["max_s"]
            assert len(figures["hook_samples_s"]) == len(samples)
        assert model["variants"]["no hooks"]["overhead_pct"] == 0.0
        assert model["variants"]["no hooks"]["hook_median_s"] == 0.0
        assert all(model["variants"][v]["hook_median_s"] > 0 for v in VARIANTS[1:])

    table = (out / "results.md").read_text().splitlines()
    rows = [line for line in table if line.startswith("| ") and "---" not in line]
    assert rows[0] == (
        "| model | variant | step ms (median) | min / max ms | overhead | hook ms / step |"
    )
    assert len(rows) == 1 + 3 * len(VARIANTS)
    assert (out / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "training steps" in run.stderr  # the progress bar


@pytest.mark.slow
def test_guard_benchmark_times_every_watch_and_says_what_each_names(tmp_path):
    pytest.importorskip("sklearn")
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "nonfinite_guard.py"), "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_script_env(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in run.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| variant")
    }
    assert rows["no watching"][3].strip(" |") == "nothing"
    assert rows["ActivationStats, guard"][3].strip(" |").endswith("module '2', forward")
    assert "loss is nan" in rows["finite loss check"][3]
    assert "autograd node" in rows["detect_anomaly"][3]
    assert all(float(row[1]) > 0 for row in rows.values())
    assert "the one call the guard changes" in run.stdout


def _run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """A benchmark script run to its end, which must succeed."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=_script_env(),
    )
    assert run.returncode == 0, run.stderr
    return run


def test_the_window_benchmark_writes_its_table(tmp_path):
    pytest.importorskip("pyarrow")
    out = tmp_path / "window"
    _run_script("window_sink.py", "--batches", "300", "--window", "8", "--out", str(out))
    table = (out / "results.md").read_text()
    # 9 columns of 50 modules at 432 bytes each (every extra, 40 bins), from first to last.
    assert "| window=8, Parquet sink | 194,400 / 194,400 / 194,400 |" in table
    results = json.loads((out / "results.json").read_text())
    assert results["window=None"]["batches"] == 300 and results["sink_bytes"] > 0


@FUSED
def test_the_parameter_monitors_benchmark_writes_its_tables_and_goals(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "monitors"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "parameter_monitors.py"),
            *("--quick", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_script_env(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads((out / "results.json").read_text())
    assert results["quick"] is True and results["parameters"] > 0
    assert list(results["step_s"]) == [
        "no monitoring",
        "ParameterStats fused, every stat + 64-bin hist",
        "ParameterStats python, every stat + 64-bin hist",
        "wandb.watch, offline",
        "Composer OptimizerMonitor (reproduced)",
        "Lightning grad_norm",
        "torch._foreach_norm, 3 kinds",
    ]
    assert all(s > 0 for s in results["step_s"].values())
    assert set(results["monitor_in_step_s"]) == set(results["step_s"]) - {"no monitoring"}
    assert all(s > 0 for s in results["monitor_in_step_s"].values())
    assert len(results["alone_s"]) == 11
    assert all(s > 0 for s in results["alone_s"].values())
    table = (out / "results.md").read_text()
    assert "| variant | ms per step | over no monitoring |" in table
    assert "| kind | ParameterStats fused ms | _foreach_norm ms | ratio |" in table
    assert "| monitor, one step's work alone | ms | over ParameterStats fused |" in table
    verdicts = [g.rsplit(": ", 1)[-1] for g in results["goals"]]
    assert len(verdicts) == 5 and set(verdicts) <= {"met", "NOT met"}, results["goals"]
    assert all(results["larger_batch_s"][k] > 0 for k in ("bare", "fused", "hooks"))


def test_roofline_vs_measured_puts_the_sass_prediction_beside_the_timing(tmp_path):
    results = {
        "machine": "NVIDIA H200",
        "dtype": "bfloat16",
        "sum_vs_fused": [
            {"size_mb": size, **{f"{m}_over_sum": ratio for m in MODES}}
            for size, ratio in ((1, 9.0), (1024, 2.5))
        ],
    }
    (tmp_path / "r.json").write_text(json.dumps(results))
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "roofline_vs_measured.py"),
            str(tmp_path / "r.json"),
            "--out",
            str(tmp_path / "out.md"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    page = (ROOT / "docs" / "cuda.md").read_text()
    for mode, name in (("mean and std", "mean and std"), ("every extra", "every statistic")):
        stated = re.search(
            rf"\| bfloat16, {name} \| H200 \(sm_90\) \|[^|]*\|[^|]*\| ([\d.]+) \|", page
        )
        bound = float(stated.group(1))
        row = f"| bfloat16, {name} | 1024 | {bound} | {max(1.0, 1 / bound):.2f} | 2.50 |"
        assert row in run.stdout, (mode, run.stdout)
    assert (tmp_path / "out.md").read_text() == run.stdout


@FUSED
def test_the_low_precision_benchmark_times_binades_beside_the_read_floor(tmp_path):
    out = tmp_path / "low_precision"
    args = ("--numel", "65536", "--rounds", "1", "--dtypes", "float32", "--out", str(out))
    _run_script("low_precision.py", *args)
    table = (out / "results.md").read_text()
    assert "| float32 | torch.sum |" in table and "| float32 | every extra + binades |" in table
    assert "| float32 | every extra + top_k=16 |" in table
    results = json.loads((out / "results.json").read_text())
    assert all(t["median_s"] > 0 for t in results["float32"].values())


@FUSED
def test_the_channel_benchmark_times_each_layout_beside_the_read_floor(tmp_path):
    out = tmp_path / "channel_stats"
    _run_script("channel_stats.py", "--numel", "65536", "--channels", "16", "--rounds", "1",
                "--out", str(out))  # fmt: skip
    table = (out / "results.md").read_text()
    for layout in ("NCHW", "channels_last", "(tokens, channels)"):
        assert f"| float32 | {layout} | mean and std + channels |" in table
    results = json.loads((out / "results.json").read_text())
    assert all(t["median_s"] > 0 for v in results.values() for t in v.values())
