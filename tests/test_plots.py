"""Pictures: figures returned and saved, readable from 3 to 300 modules, pyplot never touched."""

import subprocess
import sys

import pytest
import torch
from conftest import subprocess_env
from torch import nn

from fasthooks import ActivationStats

pytest.importorskip("matplotlib")


def _recorded(modules: int, **options) -> ActivationStats:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(modules)])
    act = ActivationStats(model, backend="python", **options)
    with act:
        for _ in range(5):
            model(torch.randn(4, 8))
            act.on_batch_end()
    return act


@pytest.mark.parametrize("modules", [3, 300])
def test_overview_has_a_labelled_heat_map_per_statistic(modules, tmp_path):
    act = _recorded(modules, extra=["near_zero", "max"])
    fig = act.plot(tmp_path / "overview.png")
    heat_maps = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in heat_maps] == ["mean", "std", "near_zero", "max"]
    for ax in heat_maps:  # every panel names its rows, a readable number of them
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_visible()]
        assert labels[0] == "0.0" and len(labels) == (3 if modules == 3 else 100)
    assert len(fig.axes) == 2 * len(heat_maps)  # each with its colour bar
    assert (tmp_path / "overview.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_stats_and_color_dim(tmp_path):
    act = _recorded(3, extra=["near_zero"], hist_bins=10, hist_range=(-1, 1))
    fig = act.plot_layer_stats("1.0", tmp_path / "layer.png")
    assert [ax.get_title() for ax in fig.axes] == ["mean", "std", "near-zero"]
    assert fig._suptitle.get_text() == "1.0 (Linear)"
    line = fig.axes[0].get_lines()[0]
    assert line.get_ydata().tolist() == act.layer_stats("1.0")["mean"].tolist()
    fig = act.color_dim(1, tmp_path / "color_dim.png")
    image = fig.axes[0].get_images()[0]
    assert image.get_array().shape == (10, 5)  # bins x batches
    assert (tmp_path / "color_dim.png").stat().st_size > 0


def test_pictures_leave_the_global_backend_alone():
    script = (
        "import sys, torch\n"
        "from torch import nn\n"
        "from fasthooks import ActivationStats\n"
        "model = nn.Sequential(nn.Linear(4, 4))\n"
        "act = ActivationStats(model, backend='python', hist_bins=4)\n"
        "with act:\n"
        "    model(torch.randn(2, 4)); act.on_batch_end()\n"
        "act.plot(); act.plot_layer_stats(0); act.color_dim(0)\n"
        "print('matplotlib.pyplot' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env=subprocess_env(),
    )
    assert out.stdout.strip() == "False"


def test_overview_of_63_modules_is_labelled_and_explains_what_it_shows(tmp_path):
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(63)])
    act = ActivationStats(model, backend="python", extra=["near_zero", "nonfinite"])
    with act:
        for batch in range(5):
            (model if batch != 2 else model[:-1])(torch.randn(4, 8))  # the last one rests once
            act.on_batch_end()
    fig = act.plot(tmp_path / "overview.png")
    heat_maps = [ax for ax in fig.axes if ax.get_images()]
    bars = [ax for ax in fig.axes if not ax.get_images()]
    fig.canvas.draw()
    for ax in heat_maps:
        assert len([t for t in ax.get_yticklabels() if t.get_visible() and t.get_text()]) == 63
        ticks = [t for t in ax.get_xticks() if 0 <= t <= 4]
        assert ticks and all(float(t).is_integer() for t in ticks)
    nonfinite_bar = bars[[ax.get_title() for ax in heat_maps].index("nonfinite")]
    assert list(nonfinite_bar.get_yticks()) == [0.0]  # constant: its one value
    assert "grey: no value" in fig._suptitle.get_text()
    assert "grey" not in _recorded(3).plot()._suptitle.get_text()
