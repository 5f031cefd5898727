import pytest
import torch
from torch import nn

from fasthooks import (
    dummy_batch,
    dummy_eval,
    in_channels,
    model_sizes,
    model_summary,
    num_features_model,
    params_size,
    total_params,
)


def _convnet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(16, 32, 3, stride=2), nn.ReLU()),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def test_model_sizes_match_a_real_forward():
    model = _convnet()
    x = torch.zeros(1, 3, 40, 48)
    expected = []
    with torch.no_grad():
        for child in model:
            x = child(x)
            expected.append(x.shape)
    assert model_sizes(model, size=(40, 48)) == expected
    assert expected[3] == torch.Size([1, 32, 9, 11])


def test_model_sizes_reports_children_that_did_not_run():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.unused = nn.Linear(2, 2)

        def forward(self, x):
            return self.conv(x)

    assert model_sizes(Skips(), size=(5, 5)) == [torch.Size([1, 2, 3, 3]), None]


def test_dummy_eval_restores_modes_and_uses_no_grad():
    model = _convnet().train()
    model[1].eval()
    out = dummy_eval(model, (8, 8))
    assert out.shape == (1, 10) and not out.requires_grad
    assert model.training and model[0].training and not model[1].training
    assert model[1].num_batches_tracked.item() == 0


def test_dummy_batch_and_in_channels():
    model = nn.Sequential(nn.BatchNorm1d(5), nn.Linear(5, 2))
    assert in_channels(model) == 5
    assert dummy_batch(model, ()).shape == (1, 5)
    assert dummy_batch(_convnet(), (7, 9)).shape == (1, 3, 7, 9)
    with pytest.raises(ValueError, match="m has no layer with a weight of 2 or more dims"):
        in_channels(nn.Sequential(nn.ReLU(), nn.BatchNorm1d(3)))


def test_num_features_model_grows_input_until_it_fits():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.MaxPool2d(64), nn.Conv2d(8, 12, 1))
    assert num_features_model(model) == 12
    assert num_features_model(_convnet()) == 10


def test_total_params_counts_own_parameters():
    conv = nn.Conv2d(3, 4, 3)
    assert total_params(conv) == (4 * 3 * 9 + 4, True)
    conv.weight.requires_grad_(False)
    conv.bias.requires_grad_(False)
    assert total_params(conv) == (112, False)
    assert total_params(nn.ReLU()) == (0, False)


def test_params_size_and_summary():
    model = _convnet()
    model[0].requires_grad_(False)
    rows = params_size(model, size=(3, 32, 32))
    assert [r.name for r in rows] == ["0", "1", "2", "3.0", "3.1", "4", "5", "6"]
    assert rows[0].output_shape == (1, 16, 16, 16) and rows[0].params == 448
    assert rows[0].trainable is False and rows[7].trainable is True
    assert rows[7].output_shape == (1, 10) and rows[7].params == 330
    text = model_summary(model, size=(3, 32, 32))
    lines = text.splitlines()
    assert lines[0].split() == ["Layer", "(type)", "Output", "shape", "Params", "Trainable"]
    assert lines[2].split() == ["0", "(Conv2d)", "[1,", "16,", "16,", "16]", "448", "False"]
    total = sum(p.numel() for p in model.parameters())
    assert f"Total params: {total:,}" in lines
    assert f"Trainable params: {total - 448:,}" in lines
    assert "Non-trainable params: 448" in lines
    with pytest.raises(ValueError, match=r"size\[0\] must be the model's 3 input channels, got 1"):
        params_size(model, size=(1, 32, 32))
