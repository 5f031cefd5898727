"""The examples of the README and docs/ run as written, and fasthooks alone imports no
framework."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import framework, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLE = re.compile(r"```python\n# example: (?P<name>[^\n]+)\n(?P<code>.*?)```", re.S)
EXAMPLES = {m["name"]: m["code"] for page in PAGES for m in EXAMPLE.finditer(page.read_text())}
# The framework each example needs, if any.
NEEDS = {
    "quickstart": None,
    "per-rank sinks": None,
    "Lightning": "lightning",
    "Hugging Face": "transformers",
    "fastai": "fastai",
    "Lightning parameters": "lightning",
    "Hugging Face parameters": "transformers",
    "fastai parameters": "fastai",
    "DDP": None,
    "FSDP2": None,
    "tensor parallelism": None,
    "pipeline stages": None,
    "fp8 fit": None,
    "massive activations": None,
    "per-channel statistics": None,
}


def test_every_framework_has_an_example():
    assert sorted(EXAMPLES) == sorted(NEEDS)


@pytest.mark.parametrize("name", sorted(NEEDS))
def test_readme_example_runs_as_written(name, tmp_path):
    if NEEDS[name] is not None:
        framework(NEEDS[name])
    run = subprocess.run(
        [sys.executable, "-c", EXAMPLES[name]],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_importing_fasthooks_imports_no_framework():
    frameworks = ["lightning", "pytorch_lightning", "transformers", "fastai", "accelerate"]
    script = (
        "import sys, fasthooks, fasthooks.integrations\n"
        f"print([m for m in {frameworks!r} if m in sys.modules])"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=subprocess_env(), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
