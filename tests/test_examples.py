"""The examples run as written and print what the README shows of them."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import subprocess_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_the_diverging_run_is_caught_where_it_began():
    pytest.importorskip("sklearn")
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "diverging.py")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.count("guard: non-finite values in training batch") == 2  # forward and backward
    first = next(line for line in out.splitlines() if line.startswith("first non-finite call"))
    assert "direction='backward'" in first  # the gradients overflowed a batch before the outputs
    assert out.count("module  found       since batch") == 2
    assert "non-finite" in out.split("forward, worst modules:")[1]
