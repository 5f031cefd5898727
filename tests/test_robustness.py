"""Bad inputs and faults: each row of docs/robustness.md, on both backends."""

import copy
import dataclasses
import gc
import math
import os
import re
import threading
import warnings
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from conftest import BACKENDS, DEVICES, reference_moments
from torch import nn

from fasthooks import ActivationStats, StatisticsError
from fasthooks.layout import EXTRAS

Pair = namedtuple("Pair", ["indices", "values"])


@dataclasses.dataclass
class Output:
    label: str
    logits: torch.Tensor


class ModelOutput(OrderedDict):
    """The shape of Hugging Face's ModelOutput: an ordered dict of named tensors."""


class Emit(nn.Module):
    """A module with a parameter whose output is whatever `make(x)` builds from its input."""

    def __init__(self, make):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.make = make

    def forward(self, x):
        return self.make(x * self.scale)


def _record(model, backend, batches=2, device="cpu", **kwargs):
    model.to(device)
    with ActivationStats(model, backend=backend, **kwargs) as act:
        for b in range(batches):
            model(torch.randn(4, 6, device=device) + b)
            act.on_batch_end()
    return act


MEASURED = {
    "dict": lambda x: {"mask": x > 0, "hidden": x},
    "dataclass": lambda x: Output("logits", x),
    "namedtuple": lambda x: Pair(x.long(), x),
    "model_output": lambda x: ModelOutput(loss=None, hidden=x),
    "nested": lambda x: [(None, {"a": x})],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", MEASURED)
def test_first_floating_tensor_of_any_container_is_measured(backend, kind, device):
    seen = []
    model = nn.Sequential(Emit(lambda x: (seen.append(x.detach()), MEASURED[kind](x))[1]))
    act = _record(model, backend, batches=1, device=device)
    want = torch.tensor(reference_moments(seen[0]), dtype=torch.float64)
    torch.testing.assert_close(act.stats[:, 0, 0].double(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_max_pool_with_indices_records_its_values(backend, device):
    pool = nn.MaxPool2d(2, return_indices=True)
    x = torch.randn(2, 3, 8, 8, device=device)
    with ActivationStats(nn.Sequential(pool), modules=[pool], backend=backend) as act:
        values, _ = pool(x)
        act.on_batch_end()
    torch.testing.assert_close(act.stats[0, 0, 0].item(), values.mean().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_and_bool_outputs_are_measured_as_float(backend, dtype, device):
    model = nn.Sequential(Emit(lambda x: (x > 0).to(dtype) if dtype == torch.bool else x.long()))
    act = _record(model, backend, batches=1, device=device, extra=["max"])
    assert not math.isnan(act.stats[0, 0, 0].item())
    assert act.extra["max"][0, 0].item() >= 0


UNMEASURABLE = {
    "complex": (lambda x: x.to(torch.complex64), "complex64 tensor"),
    "sparse": (lambda x: x.to_sparse(), "sparse_coo tensor"),
    "quantized": (
        lambda x: torch.quantize_per_tensor(x.detach(), 0.1, 0, torch.qint8),
        "qint8 tensor",
    ),
    "none": (lambda x: None, "no tensor (got NoneType)"),
    "string": (lambda x: "text", "no tensor (got str)"),
}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", UNMEASURABLE)
def test_unmeasurable_outputs_read_nan_with_one_warning_naming_the_module(backend, kind, device):
    if kind == "quantized" and device == "cuda":
        pytest.skip("quantized tensors are made on the CPU")
    make, what = UNMEASURABLE[kind]
    model = nn.Sequential(nn.Linear(6, 6), Emit(make))
    warning = rf"1 \(Emit\) returned .*{re.escape(what)}"
    with pytest.warns(RuntimeWarning, match=warning) as caught:
        act = _record(model, backend, batches=3, device=device, extra=["nonfinite"], hist_bins=4)
    assert sum("returned" in str(w.message) for w in caught) == 1  # once per module
    assert act.num_batches == 3
    assert torch.isnan(act.stats[:, 1]).all() and not torch.isnan(act.stats[0, 0]).any()
    assert act.extra["nonfinite"][1].tolist() == [0, 0, 0] and act.hist[1].sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_on_the_meta_device_reads_nan(backend):
    model = nn.Sequential(nn.Linear(6, 6)).to("meta")
    act = ActivationStats(model, backend=backend)
    with pytest.warns(RuntimeWarning, match=r"0 \(Linear\) returned a meta tensor"), act:
        model(torch.randn(4, 6, device="meta"))
        act.on_batch_end()
    assert act.stats.shape == (2, 1, 1) and torch.isnan(act.stats).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_are_one_type_and_name_the_module(backend, device):
    model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.ReLU(), nn.Linear(6, 2))).to(device)
    act = ActivationStats(model, backend=backend)
    with act:
        model(torch.randn(3, 6, device=device))
        act.on_batch_end()
        act._buffers.state = act._buffers.state.to("meta")  # a fault inside the buffers
        act._args = act._buffers.op_args()
        with pytest.raises(StatisticsError, match=r"could not record 0 \(Linear\): "):
            model(torch.randn(3, 6, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_layer_of_a_training_model_is_recorded(backend, device):
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model[1].eval()  # frozen statistics while the rest trains
    act = _record(model, backend, device=device)
    assert not torch.isnan(act.stats).any()
    model.eval()
    with act:
        model(torch.randn(4, 6, device=device))
        act.on_batch_end()
    assert torch.isnan(act.stats).all()  # an evaluating model records nothing
    model.train()
    model[1].eval()
    skipping = _record(model, backend, device=device, skip_frozen=True)
    assert torch.isnan(skipping.stats[:, 1]).all() and not torch.isnan(skipping.stats[:, 0]).any()
    with pytest.raises(TypeError, match="skip_frozen must be a bool, got int"):
        ActivationStats(model, skip_frozen=1)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_everything_is_checked_before_a_hook_is_registered():
    lin = nn.Linear(2, 2)
    model = nn.Sequential(lin, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"modules\[1\] repeats modules\[0\]"):
        ActivationStats(model, modules=[lin, lin])
    scripted = torch.jit.script(nn.Linear(2, 2))
    act = ActivationStats(model, modules=[lin, model[1]])
    act.modules.append(scripted)
    with pytest.raises(TypeError, match=r"modules\[2\] is a TorchScript module"):
        act.on_train_begin()
    assert not lin._forward_hooks and not model[1]._forward_hooks
    model(torch.randn(1, 2))  # the model still runs


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_scripted_model_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match="TorchScript module .* hook the eager module .*compile"):
        ActivationStats(torch.jit.script(nn.Sequential(nn.Linear(2, 2)))).on_train_begin()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_single_module_and_numpy_integers_are_accepted(backend):
    lin = nn.Linear(6, 6)
    act = _record(lin, backend, modules=lin, expected_batches=np.int64(3))
    assert act.modules == [lin] and act.stats.shape == (2, 1, 2)
    with pytest.raises(TypeError, match="expected_batches must be an int, got bool"):
        ActivationStats(lin, expected_batches=True)
    with pytest.raises(TypeError, match="expected_batches must be an int, got float"):
        ActivationStats(lin, expected_batches=3.0)
    with pytest.raises(TypeError, match="do_remove must be a bool, got str"):
        ActivationStats(lin, do_remove="yes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_mode_and_no_grad(backend, device):
    model = nn.Sequential(nn.Linear(6, 6)).to(device)
    act = ActivationStats(model, backend=backend, expected_batches=1, extra=["max"], hist_bins=3)
    with torch.inference_mode():
        act.on_train_begin()  # buffers made here still take updates outside
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context():
            model(torch.randn(4, 6, device=device))
        act.on_batch_end()  # past expected_batches: growth outside inference mode
    act.on_train_end()
    assert act.num_batches == 3 and not torch.isnan(act.stats).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lifecycle_faults(backend):
    model = nn.Sequential(nn.Linear(6, 6))
    act = ActivationStats(model, backend=backend)
    with pytest.raises(ArithmeticError, match="loss is NaN"), act:
        model(torch.randn(2, 6))
        act.on_batch_end()
        raise ArithmeticError("loss is NaN")
    assert not model[0]._forward_hooks and act.stats.shape == (2, 1, 1)  # kept
    act.on_train_end()  # twice: nothing happens
    with pytest.warns(RuntimeWarning, match="recorded statistics but no batch was closed"), act:
        model(torch.randn(2, 6))
    del model
    assert act.stats.shape == (2, 1, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_models_in_two_threads(backend, device):
    results = {}

    def train(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 1)).to(device)
        with ActivationStats(model, backend=backend) as act:
            for _ in range(20):
                model(torch.randn(8, 6, device=device) * seed)
                act.on_batch_end()
        results[seed] = act.stats.clone()

    threads = [threading.Thread(target=train, args=(seed,)) for seed in (1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[1].shape == results[5].shape == (2, 2, 20)
    assert results[5][1, 0].mean() > 3 * results[1][1, 0].mean()  # each its own statistics


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_stays_flat_over_ten_thousand_batches(backend):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))
    x = torch.randn(16, 32)
    act = ActivationStats(
        model, backend=backend, expected_batches=10_001, extra=EXTRAS, hist_bins=8
    )
    with act:  # the buffers for every batch are allocated (and zero-filled) here
        for batch in range(10_000):
            if batch == 1_000:
                gc.collect()
                start = _resident_bytes()
            model(x).sum().backward()
            act.on_batch_end()
        gc.collect()
        grown = _resident_bytes() - start
    assert act.num_batches == 10_000 and not torch.isnan(act.stats).any()
    assert grown < 2 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB"


@pytest.mark.parametrize("modules", [None, []])
def test_nothing_to_hook_is_said(modules):
    model = nn.Sequential(nn.ReLU(), nn.Flatten())
    with pytest.warns(RuntimeWarning, match="nothing to hook in Sequential.*pass modules="):
        act = ActivationStats(model, modules=modules, backend="python")
        act.on_train_begin()
    act.on_train_end()
    assert act.stats.shape == (2, 0, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_exception_before_the_first_batch_end_adds_no_warning(backend):
    model = nn.Sequential(nn.Linear(6, 6))
    act = ActivationStats(model, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ArithmeticError, match="loss is NaN"), act:
            model(torch.randn(2, 6))
            raise ArithmeticError("loss is NaN")
    assert not model[0]._forward_hooks and act.num_batches == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copy_of_a_hooked_module_is_left_out_and_said_once(backend):
    """copy.deepcopy (an EMA model, say) carries the hooks along; nn.DataParallel's replicas
    too. Their calls are not recorded, with one warning, and the run goes on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(16, 4)
    with ActivationStats(model, backend=backend) as act:
        twin = copy.deepcopy(model)
        model(x)
        with pytest.warns(RuntimeWarning, match="a Linear that this run did not hook"):
            twin(x * 100)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            twin(x * 100)
        act.on_batch_end()
    want = torch.tensor(reference_moments(model[0](x)), dtype=torch.float64)
    torch.testing.assert_close(act.stats[:, 0, 0].double(), want, rtol=1e-5, atol=1e-6)


def test_data_parallel_over_several_gpus_is_refused_with_what_to_do():
    model = nn.DataParallel(nn.Sequential(nn.Linear(4, 4)))
    model.device_ids = [0, 1]  # as on a machine with two GPUs
    with pytest.raises(ValueError, match="nn.DataParallel over several GPUs.*DistributedDataPar"):
        ActivationStats(model, backend="python").on_train_begin()


def test_modules_on_several_devices_are_refused_with_what_to_do():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"several devices \(cpu, meta\).*modules= the modules"):
        ActivationStats(model, backend="python").on_train_begin()
    act = ActivationStats(model, modules=[model[0], model[2]], backend="python")
    act.on_train_begin()  # the modules of one device
    act.on_train_end()
