"""The Hugging Face callback, with a real `Trainer` on a tiny BERT built from a config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import framework
from test_distributed import _free_port

from fasthooks import ActivationStats, NonFinite, NonFiniteError

transformers = framework("transformers")
from fasthooks.integrations.transformers import (  # noqa: E402
    ActivationStatsCallback,
    ParameterStatsCallback,
)

ROWS, BATCH, SEQ, HIDDEN = 40, 4, 8, 16


def _model():
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def _data() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {
            "input_ids": torch.randint(0, 50, (SEQ,), generator=generator),
            "labels": torch.tensor(i % 2),
        }
        for i in range(ROWS)
    ]


def _trainer(callback, tmp_path, **args):
    options = {
        "output_dir": str(tmp_path),
        "per_device_train_batch_size": BATCH,
        "num_train_epochs": 1,
        "report_to": "none",
        "use_cpu": True,
        "logging_steps": 2,
        "save_strategy": "no",
        "disable_tqdm": True,
        **args,
    }
    arguments = transformers.TrainingArguments(**options)
    return transformers.Trainer(
        model=_model(), args=arguments, train_dataset=_data(), callbacks=[callback]
    )


def _element_counts(act: ActivationStats) -> list[int]:
    """Elements recorded per column for the first module, from an all-covering histogram."""
    return act.hist[0, :, 0].tolist()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_column_per_optimizer_step_merging_micro_batches(tmp_path, accumulate):
    callback = ActivationStatsCallback(hist_bins=1, hist_range=(-1e4, 1e4), extra=["max"])
    trainer = _trainer(callback, tmp_path, gradient_accumulation_steps=accumulate)
    trainer.train()
    act = callback.activation_stats
    steps = ROWS // (BATCH * accumulate)
    assert act.num_batches == trainer.state.global_step == steps
    assert act.expected_batches == trainer.state.max_steps
    # The word embeddings output every token of every row of the step.
    assert act.module_names[0] == "bert.embeddings.word_embeddings"
    assert _element_counts(act) == [BATCH * accumulate * SEQ * HIDDEN] * steps
    assert act.stats.isfinite().all()
    assert all(hook.removed for hook in act.hooks)


def test_newest_column_goes_into_the_logs_of_its_step(tmp_path):
    callback = ActivationStatsCallback(log_every_n_steps=3, extra=["max"])
    trainer = _trainer(callback, tmp_path, logging_steps=5)
    trainer.train()
    act = callback.activation_stats
    tag = "activations/classifier/max"
    logged = {entry["step"]: entry for entry in trainer.state.log_history if tag in entry}
    assert sorted(logged) == [3, 6, 9]
    classifier = act.module_names.index("classifier")
    for step, entry in logged.items():
        assert entry[tag] == pytest.approx(float(act.extra["max"][classifier, step - 1]))
        assert "loss" in entry  # the step's own log, which the callback made the Trainer write


def test_a_reporter_after_the_callback_receives_the_metrics(tmp_path):
    framework("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    callback = ActivationStatsCallback(log_every_n_steps=5)
    trainer = _trainer(callback, tmp_path, report_to="tensorboard")
    trainer.callback_handler.callbacks.remove(callback)
    trainer.callback_handler.callbacks.insert(0, callback)
    trainer.train()
    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*"))))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/activations/classifier/mean")]
    assert steps == [5, 10]


def test_with_block_removes_the_hooks_when_training_raises(tmp_path):
    class Fail(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("injected failure")

    callback = ActivationStatsCallback()
    trainer = _trainer(callback, tmp_path)
    trainer.add_callback(Fail())
    with pytest.raises(RuntimeError, match="injected failure"), callback:
        trainer.train()
    act = callback.activation_stats
    assert act.num_batches == 3
    assert all(hook.removed for hook in act.hooks)


def test_raise_on_nonfinite_stops_training_cleanly(tmp_path):
    class Poison(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:
                with torch.no_grad():
                    model.classifier.weight.fill_(float("nan"))

    callback = ActivationStatsCallback(on_nonfinite="raise")
    trainer = _trainer(callback, tmp_path)
    trainer.add_callback(Poison())
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    assert caught.value.report.where == NonFinite(3, "classifier", "forward", None)
    act = callback.activation_stats
    assert act.num_batches == 4 and trainer.state.global_step == 4
    assert all(hook.removed for hook in act.hooks)


def test_arguments_are_checked_when_the_callback_is_made():
    with pytest.raises(ValueError, match="hist_range must be finite"):
        ActivationStatsCallback(hist_bins=4, hist_range=(1.0, 0.0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        ActivationStatsCallback(bogus=1)


def test_training_resumed_from_a_checkpoint_continues_the_columns(tmp_path):
    options = {"extra": ["max"], "hist_bins": 4, "hist_range": (-3.0, 3.0)}
    first = ActivationStatsCallback(**options)
    _trainer(first, tmp_path, save_strategy="steps", save_steps=5).train()
    checkpoint = tmp_path / "checkpoint-10"
    assert (checkpoint / "fasthooks_activation_stats_rank0.pt").is_file()
    resumed = ActivationStatsCallback(**options)
    trainer = _trainer(resumed, tmp_path, num_train_epochs=2)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    act = resumed.activation_stats
    assert act.num_batches == trainer.state.global_step == 20
    assert act.batches.tolist() == list(range(20))
    assert torch.equal(act.stats[:, :, :10], first.activation_stats.stats)
    assert torch.equal(act.hist[:, :10], first.activation_stats.hist)
    assert act.stats.isfinite().all()


def test_a_checkpoint_without_statistics_says_they_start_again(tmp_path):
    _trainer(ActivationStatsCallback(), tmp_path, save_strategy="steps", save_steps=5).train()
    (tmp_path / "checkpoint-5" / "fasthooks_activation_stats_rank0.pt").unlink()
    callback = ActivationStatsCallback()
    trainer = _trainer(callback, tmp_path)
    with pytest.warns(RuntimeWarning, match="resumes at step 5 but .* is missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-5"))
    assert callback.activation_stats.num_batches == 5


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress_bar"])
def test_the_console_line_stays_readable(tmp_path, capsys, disable_tqdm):
    callback = ActivationStatsCallback(log_every_n_steps=2, extra=["max", "kurtosis"])
    trainer = _trainer(callback, tmp_path, disable_tqdm=disable_tqdm)
    trainer.train()
    printed = capsys.readouterr()
    lines = [line for line in (printed.out + printed.err).splitlines() if "'loss'" in line]
    assert lines and all("activations/" not in line and len(line) < 400 for line in lines)
    assert all("statistics logged" in line for line in lines)
    tags = [tag for tag in trainer.state.log_history[0] if tag.startswith("activations/")]
    assert len(tags) == 4 * len(callback.activation_stats.module_names)


def test_a_compiled_model_is_recorded_like_the_eager_one(tmp_path):
    torch._dynamo.reset()
    eager = ActivationStatsCallback(extra=["max"])
    _trainer(eager, tmp_path / "eager").train()
    compiled = ActivationStatsCallback(extra=["max"])
    trainer = _trainer(
        compiled, tmp_path / "compiled", torch_compile=True, torch_compile_backend="aot_eager"
    )
    counters = torch._dynamo.utils.counters
    counters.clear()
    trainer.train()
    assert counters["stats"]["unique_graphs"] >= 1  # the Trainer did compile the model
    act, want = compiled.activation_stats, eager.activation_stats
    assert act.module_names == want.module_names
    assert act.num_batches == want.num_batches == trainer.state.global_step
    assert act.stats.isfinite().all() and act.extra["max"].isfinite().all()


def test_a_window_sinks_every_step_under_the_output_dir(tmp_path):
    pytest.importorskip("pyarrow")
    from fasthooks import load

    callback = ActivationStatsCallback(window=3)
    trainer = _trainer(callback, tmp_path)
    trainer.train()
    act = callback.activation_stats
    steps = trainer.state.global_step
    assert act.num_batches == steps and len(act.batches) == 3
    loaded = load(tmp_path / "fasthooks" / "activations")
    assert loaded.batches.tolist() == list(range(steps))
    assert torch.equal(loaded.stats[:, :, -3:], act.stats)


# ParameterStatsCallback ------------------------------------------------------------------------


class Trace(transformers.TrainerCallback):
    """Every optimizer step's gradients (after clipping), weights after it and updates, copied
    around `optimizer.step()` by the Trainer's own events."""

    def __init__(self) -> None:
        self.grads, self.weights, self.updates = [], [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.before = [p.detach().clone() for p in model.parameters()]
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        after = [p.detach().clone() for p in model.parameters()]
        self.weights.append(after)
        self.updates.append([a - b for a, b in zip(after, self.before, strict=True)])


def _assert_traced(ps, trace: Trace) -> None:
    """ps holds, per step and parameter, the mean, std and norm of what the trace copied."""
    traced = {"grad": trace.grads, "weight": trace.weights, "update": trace.updates}
    for kind, steps in traced.items():
        values = [[t.double() for t in step] for step in steps]
        mean = torch.tensor([[t.mean() for t in step] for step in values]).T
        std = torch.tensor([[t.std() for t in step] for step in values]).T
        norm = torch.tensor([[t.norm() for t in step] for step in values]).T
        stats, got_norm = ps.stats[kind].double(), ps.extra[kind]["norm"].double()
        torch.testing.assert_close(stats[0], mean, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(stats[1], std, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(got_norm, norm, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_parameter_stats_record_each_optimizer_step_as_traced(tmp_path, accumulate):
    callback, trace = ParameterStatsCallback(), Trace()
    trainer = _trainer(callback, tmp_path, gradient_accumulation_steps=accumulate)
    trainer.add_callback(trace)
    trainer.train()
    ps = callback.parameter_stats
    steps = ROWS // (BATCH * accumulate)
    assert ps.num_steps == trainer.state.global_step == len(trace.grads) == steps
    assert ps.expected_steps == trainer.state.max_steps
    assert ps.param_names == [name for name, _ in trainer.model.named_parameters()]
    _assert_traced(ps, trace)
    ps.optimizer.step()  # the hooks are gone: no column
    assert ps.num_steps == steps


def test_parameter_metrics_go_into_the_logs_of_their_step(tmp_path, capsys):
    callback = ParameterStatsCallback(log_every_n_steps=3)
    trainer = _trainer(callback, tmp_path, logging_steps=5, max_grad_norm=1.0)
    trainer.train()
    ps = callback.parameter_stats
    logged = {e["step"]: e for e in trainer.state.log_history if "parameters/grad/global_norm" in e}
    assert sorted(logged) == [3, 6, 9]
    tags = [tag for tag in logged[3] if tag.startswith("parameters/")]
    parameters = len(ps.param_names)
    # A norm per kind and parameter, a global norm per kind, an update ratio per parameter.
    assert len(tags) == 3 * parameters + 3 + parameters
    classifier = ps.param_index("classifier.weight")
    for step, entry in logged.items():
        for kind in ("weight", "grad", "update"):
            norm = float(ps.extra[kind]["norm"][classifier, step - 1])
            assert entry[f"parameters/{kind}/classifier.weight/norm"] == pytest.approx(norm)
        ratio = float(ps.update_ratio[classifier, step - 1])
        assert entry["parameters/update_ratio/classifier.weight"] == pytest.approx(ratio)
        # The Trainer's grad_norm is before clipping; the optimizer stepped with the clipped.
        clipped = min(entry["grad_norm"], trainer.args.max_grad_norm)
        assert entry["parameters/grad/global_norm"] == pytest.approx(clipped, rel=1e-4)
    printed = capsys.readouterr()
    assert "'loss'" in printed.out and "parameters/" not in printed.out + printed.err


def test_parameter_stats_resume_from_a_checkpoint(tmp_path):
    activations, first = ActivationStatsCallback(), ParameterStatsCallback(hist_bins=4)
    trainer = _trainer(activations, tmp_path, save_strategy="steps", save_steps=5)
    trainer.add_callback(first)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-10"
    assert (checkpoint / "fasthooks_parameter_stats_rank0.pt").is_file()
    assert (checkpoint / "fasthooks_activation_stats_rank0.pt").is_file()
    resumed, trace = ParameterStatsCallback(hist_bins=4), Trace()
    trainer = _trainer(resumed, tmp_path, num_train_epochs=2)
    trainer.add_callback(trace)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    ps, before = resumed.parameter_stats, first.parameter_stats
    assert ps.num_steps == trainer.state.global_step == 20
    assert ps.steps.tolist() == list(range(20))
    for kind in ps.kinds:
        assert torch.equal(ps.stats[kind][:, :, :10], before.stats[kind])
        assert torch.equal(ps.hist[kind][:, :10], before.hist[kind])
    final = torch.tensor([p.detach().norm() for p in trainer.model.parameters()])
    torch.testing.assert_close(ps.extra["weight"]["norm"][:, -1], final)


def test_with_block_removes_the_parameter_hooks_when_training_raises(tmp_path):
    class Fail(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise RuntimeError("injected failure")

    callback = ParameterStatsCallback(of="grad")
    trainer = _trainer(callback, tmp_path)
    trainer.add_callback(Fail())
    with pytest.raises(RuntimeError, match="injected failure"), callback:
        trainer.train()
    ps = callback.parameter_stats
    assert ps.num_steps == 3 and ps.global_norm("grad").gt(0).all()
    ps.optimizer.step()
    assert ps.num_steps == 3


def test_parameter_callback_arguments_are_checked_when_it_is_made():
    with pytest.raises(ValueError, match="hist_range must be finite"):
        ParameterStatsCallback(hist_bins=4, hist_range=(1.0, 0.0))
    with pytest.raises(TypeError, match="model: the callback hooks the model"):
        ParameterStatsCallback(model=torch.nn.Linear(2, 2))


# Several processes ------------------------------------------------------------------------------


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """One of 2 DDP ranks of a real Trainer on the CPU (gloo), as `torchrun` would start it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    activations = ActivationStatsCallback(
        extra=("max",), hist_bins=4, hist_range=(-3.0, 3.0), sink=f"{out}/activations{rank}"
    )
    parameters, trace = ParameterStatsCallback(hist_bins=4), Trace()
    trainer = _trainer(activations, Path(out) / f"run{rank}", ddp_backend="gloo")
    trainer.add_callback(parameters)
    trainer.add_callback(trace)
    trainer.train()
    assert dist.get_world_size() == 2  # the Trainer did train in two processes
    act, ps = activations.activation_stats, parameters.parameter_stats
    saved = {"stats": act.stats, "max": act.extra["max"], "hist": act.hist}
    saved["parameter_stats"] = {"stats": ps.stats, "extra": ps.extra, "hist": ps.hist}
    _assert_traced(ps, trace)  # DDP's gradients are the same on both ranks: counted once
    torch.save(saved, Path(out) / f"rank{rank}.pt")


def test_ddp_ranks_merge_both_recorders_at_the_end_of_training(tmp_path):
    pytest.importorskip("pyarrow")
    from fasthooks import load

    mp.spawn(_ddp_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    # Each rank's own batches went to its sink: merged at load time, they are the merged run.
    own = [load(tmp_path / f"activations{rank}") for rank in range(2)]
    loaded = load([tmp_path / "activations0", tmp_path / "activations1"])
    steps = ROWS // (2 * BATCH)
    for got in ranks:
        assert got["stats"].shape[-1] == steps
        torch.testing.assert_close(got["stats"], loaded.stats, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(got["max"], loaded.extra["max"])
        # Every value of a step's two batches counted once: each rank's own counts, summed.
        assert torch.equal(got["hist"], own[0].hist + own[1].hist)
    assert not torch.equal(own[0].hist, own[1].hist)  # each sink holds its rank's batches
    first, second = (got["parameter_stats"] for got in ranks)
    for kind, stats in first["stats"].items():
        assert torch.equal(stats, second["stats"][kind])
        assert torch.equal(first["hist"][kind], second["hist"][kind])
