"""The compiled QAT training path (``engine_options.compile``, qlightning/engines/fx/compiled.py).

Eagerly its traceable fake-quant is torch.ao's fused op bit for bit (every buffer after every phase);
compiled, a fit trains like the eager one (losses within float rounding) and converts to the same int8
model; ``auto`` decides from timed eager steps. Speed lives in ``python -m benchmarks compile``.
"""

from __future__ import annotations

import copy
from typing import Any
import statistics

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import make_trainer, test_accuracy
from qlightning import Phase, QuantizationAwareTraining, get_engine
from qlightning.core.compile_choice import EXPECTED_SAVING, TIMED_STEPS, CompileDecider, compile_seconds, phases_left
from qlightning.core.schedule import Milestone, Schedule
from qlightning.engines.fx.fast_fq import restore_fake_quant
from qlightning.engines.fx.compiled import compile_for_training, decompile, make_traceable
from qlightning.engines import Inputs, QuantSpec
from qlightning.engines.base import is_fused_fake_quant
from qlightning.engines import traceable
from qlightning.engines.traceable import (
    choose_qparams, compile_training_forward, fake_quantize, folded_variance, restore_fake_quants,
)
from qlightning.engines.fx.fast_fq import swap_fake_quant
from qlightning.engines.traceable import make_traceable as make_fake_quants_traceable
from qlightning.examples.digits import DigitsCNN
from qlightning.errors import ConfigError
from qlightning.examples import DigitsClassifier, DigitsDataModule
from test_fast_qat import ResBlockNet, _data, _prepare, _train

PHASES = [(0, Phase(False, False, False)), (1, Phase(False, True, False)), (2, Phase(True, True, False)),
          (4, Phase(True, False, False)), (5, Phase(True, False, True))]
ON, OFF = torch.ones(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)


@pytest.mark.parametrize("net_cls", [lambda: DigitsClassifier().net, ResBlockNet, lambda: GatedNet(), lambda: InvertedResidualNet()])
def test_traceable_fake_quant_is_torch_aos_fused_op_bit_for_bit(net_cls):
    """Float, observing, fake-quant, observers frozen, BN frozen: every output, gradient and buffer equal, with the
    ReLUs before fake-quants applied inside them (float masks, no bool for inductor to store)."""
    torch.manual_seed(0)
    x, y = _data()
    reference = _prepare(net_cls(), x, fast_qat=False)
    traceable = copy.deepcopy(reference)
    assert make_traceable(traceable) >= 5
    relu6 = any(type(m) is torch.nn.ReLU6 for m in traceable.modules())  # no plain ReLU to fuse into a fake-quant
    assert sum(m.__dict__.get("_qlightning_relu", False) for m in traceable.modules()) >= (0 if relu6 else 1)
    relus = [m for m in traceable.modules() if type(m) in (torch.nn.ReLU, torch.nn.ReLU6) or type(m).__name__.startswith("ConvBnReLU")]
    assert relus and all("forward" in m.__dict__ for m in relus)  # fused, or with the float mask (a shared ReLU)
    _train(reference, x, y, 7, PHASES)
    _train(traceable, x, y, 7, PHASES)
    expected, got = reference.state_dict(), traceable.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert decompile(traceable) >= 5
    assert [name for name, m in traceable.named_modules() if {"forward", "_qlightning_relu"} & m.__dict__.keys()] == []


def test_the_compiled_callers_flags_follow_every_write_of_the_flag_buffers(monkeypatch):
    """Before each compiled call the dispatcher copies each fake-quant's flags from its buffers, where dynamo
    guards on them, and reads a buffer's value only when it was written or replaced since (its version or
    identity): torch.ao's indexed setter, the engine's ``fill_``, a checkpoint load and a new buffer (``.to()``)
    all reach the copy, and a call with nothing written reads no flag."""
    torch.manual_seed(0)
    x, _ = _data()
    prepared = _prepare(DigitsCNN(), x, fast_qat=False)
    fqs = [m for m in prepared.modules() if is_fused_fake_quant(m)]
    make_traceable(prepared)
    flags = lambda: [m.__dict__["_qlightning_flags"] for m in fqs]  # noqa: E731
    traceable._refresh_flags(fqs)
    assert flags() == [(True, True)] * len(fqs)
    reads = []
    monkeypatch.setattr(traceable, "_flags", lambda m: reads.append(m) or (bool(m.observer_enabled[0]), bool(m.fake_quant_enabled[0])))
    traceable._refresh_flags(fqs)
    assert reads == [] and flags() == [(True, True)] * len(fqs)
    get_engine("fx").set_phase(prepared, Phase(fake_quant=False, observe=True, bn_frozen=False))  # fill_
    fqs[0].disable_observer()  # torch.ao's indexed write
    traceable._refresh_flags(fqs)
    assert flags() == [(False, False)] + [(True, False)] * (len(fqs) - 1) and len(reads) == len(fqs)
    state = copy.deepcopy(prepared.state_dict())
    get_engine("fx").set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=False))
    traceable._refresh_flags(fqs)
    assert flags() == [(False, True)] * len(fqs)
    prepared.load_state_dict(state)
    traceable._refresh_flags(fqs)
    assert flags() == [(False, False)] + [(True, False)] * (len(fqs) - 1)
    fqs[1]._buffers["observer_enabled"] = torch.zeros(1, dtype=torch.long)  # a new tensor, version 0
    fqs[1]._buffers["fake_quant_enabled"] = torch.ones(1, dtype=torch.long)
    traceable._refresh_flags(fqs)
    assert flags()[1] == (False, True)
    assert restore_fake_quants(prepared) and not [m for m in fqs if "_qlightning_flags_key" in m.__dict__]


@pytest.mark.parametrize("relu", [False, True], ids=["fake-quant", "relu-fake-quant"])
def test_the_fake_quant_saves_its_gradient_mask_as_floats_and_passes_the_gradient_aten_does(relu):
    """Inductor's C++ code stores a bool vector an element at a time: with a bool mask saved for the backward, the
    compiled fake-quant of 131k elements took 700 us instead of 35 (notes/perf.md section 26), and so did ReLU's own
    mask. The mask is 1.0 / 0.0 in the input's dtype, which is what a bool promotes to in the product: the gradient
    stays aten's (``fake_quantize_per_tensor_affine`` after ``torch.relu``)."""
    torch.manual_seed(0)
    x = (torch.randn(4, 8, 6, 6) * 3).requires_grad_()
    scale, zero_point = torch.tensor([0.02]), torch.tensor([60], dtype=torch.int32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = fake_quantize(x, scale, zero_point, 0, 127, relu=relu)
    assert saved and torch.bool not in saved, saved
    grad = torch.randn_like(x)
    out.backward(grad)
    reference = x.detach().clone().requires_grad_()
    expected = torch.fake_quantize_per_tensor_affine(torch.relu(reference) if relu else reference, scale, zero_point, 0, 127)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(x.grad, reference.grad)
    assert 0 < int((x.grad == 0).sum()) < x.numel()  # some values clipped, so the mask is tested


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    low=st.floats(-1e4, 1e4, width=32), high=st.floats(-1e4, 1e4, width=32),
    magnitude=st.sampled_from([1e-12, 1e-7, 1e-4, 1.0, 1e3]),
    qrange=st.sampled_from([(0, 127, False), (0, 255, False), (-128, 127, True), (-64, 63, True), (-7, 7, True), (0, 15, False)]),
)
def test_qparams_are_the_fused_ops_own(low, high, magnitude, qrange):
    """ChooseQuantizationParams transcribed: the same float32 scale and zero point as the op, tiny and huge ranges too."""
    qmin, qmax, symmetric = qrange
    lo, hi = sorted((low * magnitude, high * magnitude))
    running_min, running_max = torch.tensor([lo]), torch.tensor([hi])
    scale, zero_point = torch.ones(1), torch.zeros(1, dtype=torch.int32)
    torch.fused_moving_avg_obs_fake_quant(torch.zeros(1), OFF, ON, running_min, running_max, scale, zero_point,
                                          0.01, qmin, qmax, 0, False, symmetric)
    ours = choose_qparams(running_min, running_max, qmin, qmax, symmetric)
    assert (ours[0].item(), ours[1].item()) == (scale.item(), zero_point.item()), (lo, hi, qrange)


def test_auto_compiles_only_when_the_saving_pays_for_the_compiles():
    decider = CompileDecider("auto", supported=True)
    for _ in range(TIMED_STEPS + 1):
        assert decider.pending and not decider.ready()
        decider.add_step(0.1)
    assert decider.ready()
    break_even = compile_seconds(10, 3) / (0.1 * EXPECTED_SAVING)  # steps that save three compiles of 10 fake-quants
    short = copy.deepcopy(decider).decide(steps_left=0.9 * break_even, compiles=3, fake_quants=10)
    larger = copy.deepcopy(decider).decide(steps_left=1.1 * break_even, compiles=3, fake_quants=60)
    long = decider.decide(steps_left=1.1 * break_even, compiles=3, fake_quants=10)
    assert not short.compiled and long.compiled and "3 compile(s) of 10 fake-quants" in long.reason
    assert not larger.compiled  # a larger model's compile takes longer (notes/perf.md section 27)
    assert long.to_dict()["eager_step_ms"] == 100.0
    assert long.to_dict()["compile_seconds_expected"] == pytest.approx(compile_seconds(10, 3), abs=0.05)
    assert not CompileDecider("auto", supported=False).choice.compiled
    assert not CompileDecider("on", supported=True, processes=2).choice.compiled
    assert CompileDecider("on", supported=True).choice.compiled and not CompileDecider("off", True).choice.compiled
    schedule = Schedule(Milestone(epoch=3), Milestone(epoch=6), Milestone(epoch=6))
    assert [phases_left(schedule, 0, e) for e in (0, 3, 6)] == [4, 3, 1]


def test_compile_estimate_grows_with_the_model_and_is_near_what_the_benchmark_measured():
    """The first compile's estimate against ``python -m benchmarks compile``'s cold compiles of the observing phase
    (benchmarks/results/compile.json, this CPU; compile_pt2e_stop49.json and compile_mnv2_stop51.json for the PT2E
    engine): within 25 %, where one flat 90 s was a third of the
    Transformer's 290 s (section 27)."""
    import json
    from pathlib import Path

    from benchmarks.models import model_spec
    from benchmarks.suites import qlightning_prepare

    measured = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/compile.json").read_text())
    for name in ("digits_cnn", "resnet18_like", "transformer", "mobilenet_v2_like"):  # the last: stop 51's run
        spec = model_spec(name)
        fake_quants = len(get_engine("fx").describe_qparams(qlightning_prepare(spec.build(), spec.inputs(1), fast=False)))
        seconds = measured["models"][name]["first_two_steps_s"]["qlightning FX compiled"]
        assert compile_seconds(fake_quants, 1) == pytest.approx(seconds, rel=0.25), (name, seconds)
    # the PT2E engine's compiled path (stop 49, digits only): the same estimate, from its own fake-quant count
    pt2e = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/compile_pt2e_stop49.json").read_text())
    spec = model_spec("digits_cnn")
    fake_quants = len(get_engine("pt2e").describe_qparams(qlightning_prepare(spec.build(), spec.inputs(1), "pt2e")))
    seconds = pt2e["models"]["digits_cnn"]["first_two_steps_s"]["qlightning PT2E compiled"]
    assert compile_seconds(fake_quants, 1) == pytest.approx(seconds, rel=0.25), seconds
    spec = model_spec("mobilenet_v2_like")  # stop 51: 744 s
    fake_quants = len(get_engine("pt2e").describe_qparams(qlightning_prepare(spec.build(), spec.inputs(1), "pt2e")))
    mnv2 = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/compile_mnv2_stop51.json").read_text())
    seconds = mnv2["models"]["mobilenet_v2_like"]["first_two_steps_s"]["qlightning PT2E compiled"]
    assert compile_seconds(fake_quants, 1) == pytest.approx(seconds, rel=0.25), seconds
    assert compile_seconds(10, 0) == 0 and compile_seconds(10, 2) < 2 * compile_seconds(10, 1)


def test_compile_option_is_checked_with_its_choices():
    with pytest.raises(ConfigError, match=r"engine_options.compile='sometimes': one of \['auto', 'on', 'off'\]"):
        QuantizationAwareTraining(engine_options={"compile": "sometimes"})
    with pytest.raises(ConfigError, match=r"engine_options.compile='sometimes': one of \['auto', 'on', 'off'\]"):
        QuantizationAwareTraining(engine="pt2e", engine_options={"compile": "sometimes"})
    for value in ("auto", "on", "off", True, False):
        QuantizationAwareTraining(engine_options={"compile": value})
        QuantizationAwareTraining(engine="pt2e", engine_options={"compile": value})


def _fit(compile_mode: str, seed: int = 0, engine: str = "fx"):
    pl.seed_everything(seed)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    # two phases (fake-quant with observers, then observers and BN frozen): two compiles; each epoch ends on a
    # smaller batch (1257 = 19 x 64 + 41), in both phases, which must not recompile
    qat = QuantizationAwareTraining(modules=["net"], fake_quant_start={"step": 0}, observer_freeze={"step": 60},
                                    bn_freeze={"step": 60}, engine=engine, engine_options={"compile": compile_mode})
    trainer = make_trainer([qat, Losses()], max_epochs=-1, max_steps=90, limit_val_batches=2, val_check_interval=15)
    trainer.fit(model, datamodule=dm)
    return model, dm, qat, losses


@pytest.mark.slow  # two short fits, one of them compiled: inductor's compiles dominate (~1-3 min on 2 cores)
@pytest.mark.parametrize("engine", ["fx", "pt2e"])
def test_compiled_fit_trains_like_eager_and_converts_to_the_same_int8_model(engine):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_model, dm, eager_qat, eager_losses = _fit("off", engine=engine)
    compiled_model, _, compiled_qat, compiled_losses = _fit("on", engine=engine)
    assert compiled_qat.session.compile_choice["compiled"] and not eager_qat.session.compile_choice["compiled"]
    frames = torch._dynamo.utils.counters["frames"]
    # one graph per phase: the phase change recompiled once, the last batches not at all (eval stays eager; PT2E's
    # graph, rewritten for every validation and back, compiles once per distinct graph)
    assert frames["ok"] == 2, dict(frames)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    # the same computation up to float rounding (inductor's reduction order; a value on a rounding boundary of
    # the fake-quant grid can land on the other side), which compounds chaotically over many steps, as in
    # compiled float training: the first steps close, the end alike
    assert compiled_losses[0] == pytest.approx(eager_losses[0], rel=1e-3)
    assert compiled_losses[:5] == pytest.approx(eager_losses[:5], rel=1e-2)
    late = statistics.mean(compiled_losses[-10:]), statistics.mean(eager_losses[-10:])
    assert abs(late[0] - late[1]) <= 0.1 * late[1] + 0.02, late
    dm.setup()
    x, _ = dm.splits["test"].tensors
    with torch.no_grad():
        agreement = (eager_model.net(x).argmax(1) == compiled_model.net(x).argmax(1)).float().mean().item()
    accuracies = test_accuracy(eager_model.net, dm), test_accuracy(compiled_model.net, dm)
    assert accuracies[0] > 0.9 and abs(accuracies[1] - accuracies[0]) <= 0.02, accuracies
    assert agreement >= 0.97, (agreement, accuracies)
    # converted from the decompiled module: the fake-quant copy the parity gate and exports use is eager
    fake_quant = compiled_qat.fake_quant_modules["net"]
    assert not any("_qlightning_compiled" in m.__dict__ or "_qlightning_flags" in m.__dict__ for m in fake_quant.modules())


def test_an_epochs_last_smaller_batch_does_not_recompile():
    """The batch dimension is dynamic from the first compile: a second compile for the last batch cost as much as
    the first (42 s for the digits CNN) in every phase. Graphs are counted with a backend that runs them eagerly."""
    torch._dynamo.reset()
    x, y = _data()
    prepared = _prepare(DigitsClassifier().net, x)
    get_engine("fx").set_phase(prepared, Phase(True, True, False))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    restore_fake_quant(prepared)  # as FxEngine.compile_training does before compiling
    compile_for_training(prepared, backend=counting_backend)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for batch in (64, 17, 33, 64):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(prepared(x[:batch]), y[:batch]).backward()
        optimizer.step()
    assert len(graphs) == 1, graphs
    torch._dynamo.reset()


class TwoLinearNet(torch.nn.Module):
    """Two Linear layers and a ReLU: the smallest net whose QAT graph inductor compiles in a few seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@pytest.mark.slow  # inductor compiles the forward and backward twice: ~40 s on a cold cache
def test_inductors_wrapper_leaves_size_checks_to_dynamos_guards_and_a_restrided_weight_recompiles():
    """Inductor's generated wrapper asserted every graph input's sizes and strides on every call (one
    ``assert_size_stride`` per parameter, buffer, scale and range: 113 a digits QAT step at ~0.4 us each). The
    compiled path turns those asserts off (``traceable.LEAN_WRAPPER_OPTIONS``): its forward and backward code call
    none. What they checked, dynamo's guards check before the call: a weight replaced by one of other strides
    recompiles, and the compiled step computes what the eager one does. Both engines compile through
    ``traceable.compile_training_forward``, where the options are set: the FX engine's is checked."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine("fx")
    prepared = engine.prepare(TwoLinearNet(), Inputs((x[:8],)), QuantSpec(backend="x86"))
    engine.set_phase(prepared, Phase(True, True, False))
    eager = copy.deepcopy(prepared)
    assert engine.compile_training(prepared)

    def step(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        model.train()
        for p in model.parameters():
            p.grad = None
        loss = torch.nn.functional.cross_entropy(model(x[:32]), y[:32])
        loss.backward()
        return loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])

    (loss, grads), codes = run_and_get_code(step, prepared)
    assert len(codes) >= 2 and not [c for c in codes if "assert_size_stride(" in c]  # forward and backward wrappers
    torch.testing.assert_close((loss, grads), step(eager), rtol=1e-5, atol=1e-6)
    graphs = counters["stats"]["unique_graphs"]
    for model in (prepared, eager):
        weight = dict(model.named_parameters())["fc1.weight"]
        column_major = weight.detach().t().contiguous().t()  # the same values, other strides
        assert column_major.stride() != weight.stride()
        with torch.no_grad():
            weight.set_(column_major.clone())
    torch.testing.assert_close(step(prepared), step(eager), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] > graphs
    torch._dynamo.reset()


def test_engine_compile_pair_is_symmetric():
    x, _ = _data()
    engine = get_engine("fx")
    prepared = _prepare(DigitsClassifier().net, x)
    assert engine.compiles_training and engine.compile_training(prepared)
    assert "forward" in prepared.__dict__
    clone = copy.deepcopy(prepared)  # a copy runs eagerly (the dispatcher calls only its own module's graph)
    with torch.no_grad():
        clone.eval()
        clone(x)
    engine.decompile(prepared)
    assert "forward" not in prepared.__dict__ and "_qlightning_compiled" not in prepared.__dict__


def _pt2e_prepared(net: torch.nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    return get_engine("pt2e").prepare(net, Inputs((x[:8],)), QuantSpec(backend="x86"))


def _train_with_engine(engine, model, x, y, steps: int, phases=(), validate: bool = False) -> None:
    """``steps`` SGD steps of ``model`` switching to ``phases`` (``(step, phase)``) as the callback does, each
    step after an eval-mode forward without grad where ``validate`` (Lightning's validation loop)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        for at, phase in phases:
            if step == at:
                engine.set_phase(model, phase)
        if validate:
            model.eval()
            with torch.no_grad():
                model(x[:16])
        model.train()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[: 64 - 7 * (step % 3)]), y[: 64 - 7 * (step % 3)]).backward()
        optimizer.step()


def _instance_forwards(module: torch.nn.Module) -> dict:
    return {name: getattr(m.__dict__["forward"], "__func__", m.__dict__["forward"])
            for name, m in module.named_modules() if "forward" in m.__dict__}


@pytest.mark.parametrize("net_cls", [DigitsCNN, ResBlockNet])
def test_pt2e_traceable_fake_quant_is_torchaos_fused_op_bit_for_bit(net_cls):
    """torchao's ``FusedMovingAvgObsFakeQuantize`` runs the fused op torch.ao's does: the same traceable forward
    reproduces it through every phase, BatchNorm freeze included; restoring gives back the eager path's own forwards
    (``lean_float_phase``'s on the per-tensor ones)."""
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine("pt2e")
    reference = _pt2e_prepared(net_cls(), x)
    traceable = copy.deepcopy(reference)
    eager_forwards = _instance_forwards(traceable)
    assert eager_forwards, "lean_float_phase gave no fake-quant a forward of its own"
    made = make_fake_quants_traceable(traceable)
    assert len(made) >= 6 and all(is_fused_fake_quant(m) for m in made)
    _train_with_engine(engine, reference, x, y, 7, PHASES)
    _train_with_engine(engine, traceable, x, y, 7, PHASES)
    expected, got = reference.state_dict(), traceable.state_dict()
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert restore_fake_quants(traceable) == len(made)
    assert _instance_forwards(traceable) == eager_forwards


def test_pt2e_compiles_once_per_distinct_graph_whatever_the_batch_and_the_validations():
    """PT2E rewrites its graph's BatchNorm and dropout nodes for every eval() and train() (Lightning's validation)
    and for the BatchNorm freeze, which regenerates the GraphModule's code: one compile per distinct graph, not one
    per validation. Graphs are counted with a backend that runs them eagerly."""
    torch._dynamo.reset()
    x, y = _data()
    engine = get_engine("pt2e")
    prepared = _pt2e_prepared(DigitsCNN(), x)
    engine.set_phase(prepared, Phase(True, True, False))
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    assert engine.compiles_training
    compile_training_forward(prepared, make_fake_quants_traceable(prepared), backend=counting_backend)
    _train_with_engine(engine, prepared, x, y, 4, validate=True)
    assert len(graphs) == 1, graphs
    engine.set_phase(prepared, Phase(True, False, True))  # observers and BatchNorm frozen: a new graph
    statistics_before = {k: v.clone() for k, v in prepared.state_dict().items() if "running_" in k}
    _train_with_engine(engine, prepared, x, y, 4, validate=True)
    assert len(graphs) == 2, graphs
    # the new graph is the frozen one (a compile of the graph code of the first phase would still update them)
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in statistics_before.items())
    engine.decompile(prepared)
    assert "forward" not in prepared.__dict__ and not any("_qlightning_flags" in m.__dict__ for m in prepared.modules())
    torch._dynamo.reset()


def test_auto_times_eager_steps_then_compiles_a_run_long_enough(monkeypatch):
    """``auto``: eager for the timed steps, then one decision; with compiling made free it compiles (the engine's
    compile is recorded here, not run: the compiled fit is the slow test above)."""
    from qlightning.core import compile_choice
    from qlightning.engines.fx.engine import FxEngine

    calls = []
    monkeypatch.setattr(compile_choice, "compile_seconds", lambda fake_quants, compiles: 0.0)
    monkeypatch.setattr(FxEngine, "compile_training", lambda self, module: calls.append(module) or True)
    pl.seed_everything(0)
    steps = []

    class Steps(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append((trainer.global_step, len(calls)))

    qat = QuantizationAwareTraining(modules=["net"], fake_quant_start={"step": 3}, observer_freeze={"step": 10})
    trainer = make_trainer([Steps(), qat], max_epochs=-1, max_steps=12, limit_val_batches=0)
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(seed=0))
    assert len(calls) == 1 and isinstance(calls[0], torch.fx.GraphModule)
    assert [s for s, n in steps if n == 0] == list(range(1, TIMED_STEPS + 2))  # the timed steps ran eager
    choice = qat.session.compile_choice
    assert choice["compiled"] and choice["mode"] == "auto" and choice["steps_left"] == 12 - TIMED_STEPS - 1
    assert choice["compiles_expected"] == 2  # fake-quant on, observers still to freeze


def test_auto_stays_eager_on_a_short_fit():
    pl.seed_everything(0)
    qat = QuantizationAwareTraining(modules=["net"], fake_quant_start={"step": 3}, observer_freeze={"step": 10})
    make_trainer([qat], max_epochs=-1, max_steps=12, limit_val_batches=0).fit(DigitsClassifier(), datamodule=DigitsDataModule(seed=0))
    choice = qat.session.compile_choice
    assert not choice["compiled"] and "compile(s)" in choice["reason"] and choice["eager_step_ms"] > 0


class ConvBnFold(torch.nn.Module):
    """The conv-bn QAT fold as torch.ao's ``ConvBn2d`` and torchao's PT2E pattern compute it: the weight scaled by
    gamma / sqrt(running_var + eps), the conv output scaled back, then a training batch_norm, which updates
    running_var in place."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 4, 3, 3))
        self.bn = torch.nn.BatchNorm2d(8, momentum=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.bn.weight / torch.sqrt(self.bn.running_var + self.bn.eps)
        y = torch.nn.functional.conv2d(x, self.weight * scale.reshape(-1, 1, 1, 1)) / scale.reshape(1, -1, 1, 1)
        return torch.nn.functional.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight,
                                              self.bn.bias, True, self.bn.momentum, self.bn.eps)


def test_inductor_backward_of_the_conv_bn_fold_reads_the_updated_running_variance():
    """Why the engines' compiled folds read the running variance from a snapshot (``traceable.folded_variance``):
    the fold's scale cancels in the output, so the weight's gradient of a per-channel weighted sum after batch_norm
    is ~0 eagerly; inductor's backward scales by the variance after the batch_norm's in-place update and gets a large
    one. When this test fails, torch has fixed it, and the snapshot can go."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module, x = ConvBnFold(), torch.randn(16, 4, 8, 8) * 3
    grads = []
    for compiled in (False, True):
        m = copy.deepcopy(module)
        f = torch.compile(m) if compiled else m
        (f(x) * torch.arange(8.0).reshape(1, -1, 1, 1)).sum().backward()
        grads.append(float(m.weight.grad.abs().sum()))
    torch._dynamo.reset()
    assert grads[0] < 1e-2 and grads[1] > 1.0, grads


class LinearBnNet(torch.nn.Module):
    """Linear + BatchNorm1d, which torch.ao fuses into its ``LinearBn1d`` QAT module (the same fold as conv-bn)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))


class GatedNet(torch.nn.Module):
    """Conv-BN-ReLU with a hardsigmoid gate (MobileNetV3's squeeze-excite), whose output torch.ao's defaults fake-quantize
    with fixed qparams (``FixedQParamsFakeQuantize``: a graph break when compiled, until it got a traceable forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.gate, self.fc = torch.nn.Hardsigmoid(), torch.nn.Linear(8 * 64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.fc((y * self.gate(y)).flatten(1))


class InvertedResidualNet(torch.nn.Module):
    """MobileNetV2's inverted residual (expand conv-bn-ReLU6, depthwise conv-bn-ReLU6, project conv-bn, the skip add).
    Under torch.ao's x86 config a ReLU6 shares its input's fake-quant: the FX graph calls that fake-quant twice."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU6())
        self.block = torch.nn.Sequential(
            torch.nn.Conv2d(8, 24, 1, bias=False), torch.nn.BatchNorm2d(24), torch.nn.ReLU6(inplace=True),
            torch.nn.Conv2d(24, 24, 3, padding=1, groups=24, bias=False), torch.nn.BatchNorm2d(24), torch.nn.ReLU6(inplace=True),
            torch.nn.Conv2d(24, 8, 1, bias=False), torch.nn.BatchNorm2d(8))
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return self.fc((y + self.block(y)).mean((2, 3)))


@pytest.mark.parametrize("engine_name,net_cls", [("fx", InvertedResidualNet), ("pt2e", InvertedResidualNet),
                                                  ("pt2e", ResBlockNet)])
def test_compiled_relus_save_no_bool_mask_for_the_backward(engine_name, net_cls):
    """``nn.ReLU6``'s and ``nn.ReLU``'s aten backwards (``hardtanh_backward``, ``threshold_backward``) take a mask that
    inductor's partitioner saved as a bool tensor, which its C++ code stores an element at a time: the
    MobileNetV2-like net's FX compiled observing step ran at 2.99x the float step against 1.66x eager (notes/perf.md
    section 36), and PT2E's ReLUs in residual blocks (a ReLU feeding its fake-quant and the skip add) saved one too:
    the ResNet-18-like net's PT2E compiled observing step 1.21x against FX's 1.05x (section 37). ReLU and ReLU6 now
    get a float mask in both engines: the forward graph that inductor's decompositions and min-cut partitioner make
    saves no bool tensor larger than a channel vector (checked on that partition, without inductor's code generation), the compiled loss is the
    eager one (bit for bit through FX), and ``decompile`` gives back the eager model's own forwards and graphs."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    saved_dtypes = []

    def forward_compiler(gm: torch.fx.GraphModule, example_inputs):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        saved_dtypes.extend((a.meta["val"].dtype, a.meta["val"].numel()) for a in output.args[0]
                            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor))
        return make_boxed_func(gm.forward)

    from torch._inductor.decomposition import select_decomp_table

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine(engine_name)
    prepared = engine.prepare(net_cls(), Inputs((x[:8],)), QuantSpec(backend="x86"))
    engine.set_phase(prepared, Phase(True, True, False))
    eager = copy.deepcopy(prepared)
    codes = {name: m.code for name, m in prepared.named_modules() if isinstance(m, torch.fx.GraphModule)}
    assert engine.compile_training(prepared, backend=backend)
    losses = []
    for model in (prepared, eager):
        model.train()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.detach())
    # a bool as large as an activation; the fold's mask of gamma-0 channels is one per channel (stop 55)
    channels = max(p.shape[0] for p in eager.parameters())
    assert saved_dtypes and not [n for dtype, n in saved_dtypes if dtype is torch.bool and n > channels], saved_dtypes
    if engine_name == "fx":
        assert torch.equal(*losses)
    else:  # the exported graph's ops decompose into others than eager's (its compiled loss differed before too)
        torch.testing.assert_close(*losses, rtol=2e-5, atol=0.0)
    if engine_name == "fx":
        assert sum(type(m) is torch.nn.ReLU6 and "forward" in m.__dict__ for m in prepared.modules()) == 3
    else:
        assert "aten.relu" not in prepared.code and "aten.hardtanh" not in prepared.code
    engine.decompile(prepared)
    assert not [m for m in prepared.modules() if type(m) is torch.nn.ReLU6 and "forward" in m.__dict__]
    assert {name: m.code for name, m in prepared.named_modules() if isinstance(m, torch.fx.GraphModule)} == codes
    torch._dynamo.reset()


@pytest.mark.parametrize("engine_name,net_cls", [("fx", DigitsCNN), ("fx", LinearBnNet), ("fx", GatedNet), ("pt2e", DigitsCNN)])
def test_compiled_steps_compute_the_eager_gradients_while_batch_norm_statistics_train(engine_name, net_cls):
    """The compiled backward of the conv-bn (linear-bn) fold read the running variance after the training batch_norm
    had updated it: gradients 4.7 % off on the digits CNN in both engines (notes/perf.md section 34). The folds now
    read a snapshot taken before each compiled call. ``aot_eager`` builds the forward and backward graphs as
    inductor's are built, run as eager aten ops: gradients equal the eager module's in every phase, BatchNorm
    statistics too, and so does a step that calls the model twice before one backward (a fresh snapshot per call).
    No graph breaks, a fixed-qparams fake-quant included."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine(engine_name)
    prepared = engine.prepare(net_cls(), Inputs((x[:8],)), QuantSpec(backend="x86"))
    if net_cls in (LinearBnNet, GatedNet):
        kind = "LinearBn1d" if net_cls is LinearBnNet else "FixedQParamsFakeQuantize"
        assert any(type(m).__name__ == kind for m in prepared.modules())
    engine.set_phase(prepared, Phase(True, True, False))
    with torch.no_grad():
        prepared(x)  # observed ranges, so the fake-quant phases quantize
    targets = _graph_targets(prepared)
    assert engine.compile_training(prepared, backend="aot_eager")
    if engine_name == "pt2e":  # the fold's reads through folded_variance
        assert folded_variance in _graph_targets(prepared)
    eager = copy.deepcopy(prepared)  # a copy runs eagerly through the same forwards
    for phase, twice in ((Phase(True, True, False), False), (Phase(True, False, False), False),
                         (Phase(True, False, False), True), (Phase(True, False, True), False)):
        grads = []
        for model in (prepared, eager):
            engine.set_phase(model, phase)
            model.train().zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if twice:
                loss = loss + torch.nn.functional.cross_entropy(model(x[:32] * 0.5), y[:32])
            loss.backward()
            grads.append([p.grad for p in model.parameters() if p.grad is not None])
        worst = max(float((g - e).abs().max() / e.abs().max().clamp(min=1e-12)) for g, e in zip(*grads))
        assert len(grads[0]) == len(grads[1]) and worst < 1e-6, (phase, twice, worst)
    state, eager_state = prepared.state_dict(), eager.state_dict()
    assert [k for k in state if not torch.allclose(state[k].float(), eager_state[k].float(), rtol=1e-5, atol=1e-7)] == []
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 2 and not torch._dynamo.utils.counters["graph_break"]
    engine.decompile(prepared)
    assert not [k for m in prepared.modules() for k in m._buffers if "folded" in k]
    assert _graph_targets(prepared) == targets and not [m for m in prepared.modules() if "_forward_approximate" in m.__dict__]
    torch._dynamo.reset()


def _graph_targets(module: torch.nn.Module) -> list:
    return [n.target for g in module.modules() if isinstance(g, torch.fx.GraphModule) for n in g.graph.nodes]


def _aot_graphs() -> tuple[list, Any]:
    """A list and a ``torch.compile`` backend that appends to it aot_autograd's forward and backward aten graphs
    (run as eager aten ops, no code generation)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return graphs, aot_autograd(fw_compiler=capture, bw_compiler=capture)


class ConvBiasBnNet(torch.nn.Module):
    """Convolutions with their own bias before BatchNorm (the folds add it after taking the scale back out)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))).mean((2, 3)))


@pytest.mark.parametrize("engine_name,net_cls", [("fx", DigitsCNN), ("fx", LinearBnNet), ("fx", InvertedResidualNet),
                                                  ("fx", ConvBiasBnNet), ("pt2e", DigitsCNN),
                                                  ("pt2e", InvertedResidualNet), ("pt2e", ConvBiasBnNet)])
def test_the_folds_divide_the_weight_and_fold_a_frozen_batch_norm_whole(engine_name, net_cls):
    """torch.ao's and torchao's conv-bn (linear-bn) QAT folds divide the layer's full output by ``gamma /
    running_std`` and, with the BatchNorm frozen, still run it over that output: compiled, a fused pass forward and
    reductions backward each. FX compiled with BatchNorm frozen was slower than with it training (stem + 2
    BasicBlocks 127 ms against 117; 3 inverted-residual blocks 1.44x the float step, PT2E 1.12x; notes/perf.md
    section 38). Frozen, the folds now fold the BatchNorm whole into the layer's bias, eagerly (the FX fast path)
    and compiled (both engines), and while BatchNorm trains they divide the weight (both engines; PT2E since stop
    54): the compiled aten graphs hold no output-sized division and, frozen, no batch_norm either; no conv-bn's
    BatchNorm module runs eagerly when frozen (FX); losses and gradients are the uncompiled fold's (torch.ao's own,
    the fast path off, for FX) up to float rounding in every phase, and so is the int8 model."""
    graphs, capture = _aot_graphs()
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine(engine_name)
    if engine_name == "fx":
        reference = _prepare(net_cls(), x, fast_qat=False)  # torch.ao's modules, eager
    else:
        reference = engine.prepare(net_cls(), Inputs((x[:8],)), QuantSpec(backend="x86"))
        engine.set_phase(reference, Phase(True, True, False))
    with torch.no_grad():
        reference(x)  # observed ranges, so the fake-quant phases quantize
    eager, compiled = copy.deepcopy(reference), copy.deepcopy(reference)
    if engine_name == "fx":
        assert swap_fake_quant(eager, fake_quant=True, conv_bn=True, linear=True)
    assert engine.compile_training(compiled, backend=capture)
    # the FX fast path folds conv-bn eagerly (torch.ao's LinearBn1d, rare, runs its own forward)
    batch_norms = [m.bn for m in eager.modules() if hasattr(m, "_forward_approximate")] if engine_name == "fx" else []
    bn_calls = []
    for bn in batch_norms:
        bn.register_forward_hook(lambda *_: bn_calls.append(1))
    largest_weight = max(p.numel() for p in reference.parameters())
    for phase in (Phase(True, True, False), Phase(True, False, True)):
        del graphs[:], bn_calls[:]
        losses, grads = [], []
        for model in (reference, eager, compiled):
            model.train().zero_grad(set_to_none=True)
            engine.set_phase(model, phase)  # after train(), as the callback does each batch (LinearBn1d's eval)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.detach())
            grads.append([p.grad for p in model.parameters()])
        # up to float rounding, which can move a value across a fake-quant's rounding edge (a bias before a training
        # BatchNorm has a gradient of rounding noise only: the bound is each gradient's norm, or the largest's / 1000)
        for got in (1, 2):
            torch.testing.assert_close(losses[got], losses[0], rtol=1e-4, atol=0.0)
            floor = 1e-3 * max(float(e.norm()) for e in grads[0])
            off = [float((g - e).norm()) / max(float(e.norm()), floor) for g, e in zip(grads[got], grads[0])]
            assert max(off) < 1e-2, (phase, got, off)
        frozen = phase.bn_frozen
        ops = [(str(n.target), n.meta["val"].numel()) for g in graphs for n in g.graph.nodes
               if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
        divisions = [op for op in ops if op[0] == "aten.div.Tensor" and op[1] > largest_weight]
        assert graphs and not divisions, (phase, divisions)
        assert any("batch_norm" in str(n.target) for g in graphs for n in g.graph.nodes) != frozen, phase
        assert (len(bn_calls) == 0) == (frozen or not batch_norms), phase
    spec = QuantSpec(backend="x86")
    codes = {name: m.code for name, m in reference.named_modules() if isinstance(m, torch.fx.GraphModule)}
    engine.decompile(compiled)
    assert {name: m.code for name, m in compiled.named_modules() if isinstance(m, torch.fx.GraphModule)} == codes
    compiled_int8, reference_int8 = engine.convert(copy.deepcopy(compiled), spec), engine.convert(copy.deepcopy(reference), spec)
    compiled.load_state_dict(reference.state_dict())
    with torch.no_grad():
        assert torch.equal(engine.convert(compiled, spec)(x), reference_int8(x))
        assert (compiled_int8(x).argmax(1) == reference_int8(x).argmax(1)).float().mean() >= 0.95
    torch._dynamo.reset()


def _full_size_reductions(graphs: list, smallest: int) -> int:
    """min / max reductions over tensors of more than ``smallest`` elements in aot_autograd's aten graphs."""
    reductions = {"aten.aminmax.default", "aten.amin.default", "aten.amax.default", "aten.min.default", "aten.max.default"}
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and str(n.target) in reductions
               and n.args[0].meta["val"].numel() > smallest)


def test_a_fake_quant_shared_across_a_relu6_observes_once_compiled():
    """Under torch.ao's x86 config a ReLU6 shares its input's fake-quant, so the FX graph calls one fake-quant
    before and after it, and compiled each call observed its input in full: a min/max reduction per ReLU6 on top of
    the conv-bn output's (3-block MobileNetV2-like FX compiled observing step 178 ms, PT2E's 165 ms; notes/perf.md
    section 39). The second call's range is the first's output range through the ReLU6, a few scalar ops. The
    compiled observing graph reads each of these tensors once; every buffer and gradient is bit for bit what the
    unfused compiled graph gives over every phase (aot_eager: the same aten ops, run eagerly), and the same as
    torch.ao's own eager modules up to the float rounding every compiled fold has; decompile gives torch.ao's graph
    back, node names included (convert reads qconfigs by them), and the same int8 model."""
    import qlightning.engines.fx.compiled as compiled_module

    graphs, capture = _aot_graphs()
    torch._dynamo.reset()
    torch.manual_seed(0)
    x, y = _data()
    engine = get_engine("fx")
    reference = _prepare(InvertedResidualNet(), x, fast_qat=False)  # torch.ao's modules, eager
    names = [n.name for n in reference.graph.nodes]
    fused, unfused = copy.deepcopy(reference), copy.deepcopy(reference)
    engine.compile_training(fused, backend=capture)
    fuse = compiled_module._fuse_shared_fake_quants
    compiled_module._fuse_shared_fake_quants = lambda module: 0
    try:
        engine.compile_training(unfused, backend=capture)
    finally:
        compiled_module._fuse_shared_fake_quants = fuse
    smallest = max(p.numel() for p in reference.parameters())
    readings = []
    for model in (fused, unfused, reference):
        del graphs[:]
        model.train()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        readings.append(_full_size_reductions(graphs, smallest))
    relu6_sites = sum(1 for m in reference.modules() if type(m) is torch.nn.ReLU6)
    assert relu6_sites == 3 and readings[0] == readings[1] - relu6_sites and readings[2] == 0, readings
    for model in (fused, unfused, reference):
        _train_with_engine(engine, model, x, y, 7, PHASES, validate=True)
    state, unfused_state, reference_state = fused.state_dict(), unfused.state_dict(), reference.state_dict()
    assert [k for k in state if not torch.equal(state[k], unfused_state[k])] == []
    assert [k for k in state if not torch.allclose(state[k].float(), reference_state[k].float(), rtol=1e-4, atol=1e-5)] == []
    engine.decompile(fused)
    assert [n.name for n in fused.graph.nodes] == names and fused.code == reference.code
    spec = QuantSpec(backend="x86")
    fused.load_state_dict(reference_state)
    with torch.no_grad():
        assert torch.equal(engine.convert(fused, spec)(x), engine.convert(reference, spec)(x))
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_a_channel_whose_gamma_is_zero_gets_the_float_models_gradient_through_the_fold(path):
    """A conv-bn fold with gamma exactly 0 in some channels (zero-init residual BatchNorms), fake-quant on and
    BatchNorm training: torch.ao's fold, and the engine's eager and compiled folds until stop 55, computed 0 / 0 there
    (NaN). Now those channels convolve with the weight itself: their output is beta, as a BatchNorm of gamma 0 gives,
    and gamma's gradient is the float conv-bn's (the normalized conv output), so the gamma trains from 0."""
    from torch.ao.nn.intrinsic.qat import ConvBn2d

    from qlightning.engines.fx.compiled import _folds_from_snapshots

    torch.manual_seed(0)
    x, _ = _data(16)
    prepared = _prepare(torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8)), x)
    with torch.no_grad():
        prepared(x)  # observed ranges, so the weight fake-quant quantizes
    conv_bn = next(m for m in prepared.modules() if isinstance(m, ConvBn2d))
    zero = torch.arange(8) % 2 == 0
    with torch.no_grad():
        conv_bn.bn.weight[zero] = 0
    fold = conv_bn
    if path == "compiled":
        restore_fake_quant(prepared)
        make_fake_quants_traceable(prepared)
        _folds_from_snapshots(conv_bn)
        torch._dynamo.reset()
        fold = torch.compile(conv_bn, backend="aot_eager", fullgraph=True)
    out = fold(x)
    dy = torch.randn_like(out)
    out.backward(dy)
    gamma = conv_bn.bn.weight.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.batch_norm(
        torch.nn.functional.conv2d(x, conv_bn.weight.detach(), conv_bn.bias.detach(), padding=1), None, None, gamma,
        conv_bn.bn.bias.detach(), training=True, eps=conv_bn.bn.eps)
    expected.backward(dy)
    assert torch.isfinite(out).all() and torch.isfinite(conv_bn.weight.grad).all()
    torch.testing.assert_close(out[:, zero], conv_bn.bn.bias.detach()[zero].reshape(1, -1, 1, 1).expand_as(out[:, zero]))
    torch.testing.assert_close(conv_bn.bn.weight.grad[zero], gamma.grad[zero], rtol=1e-4, atol=1e-6)
    assert bool((conv_bn.bn.weight.grad[zero] != 0).all())
    # compiled, then decompiled with the gammas still 0 (the fit-end copy, a channel that never trained): no 0 / 0
    engine = get_engine("fx")
    torch._dynamo.reset()
    assert engine.compile_training(prepared, backend="aot_eager")
    engine.decompile(prepared)
    assert torch.isfinite(prepared.train()(x)).all()


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_pt2e_folds_give_a_channel_of_gamma_zero_the_float_models_gradient(path):
    """The PT2E engine's counterpart of the test above, through the prepared graph: torchao's fold (and the compiled
    fold until stop 55) divided 0 / 0 where gamma is 0. The channel convolves the layer's own weight (divided by 1;
    compiled, the fold's weight is the weight itself there): its output is beta and gamma's gradient is the float
    conv-bn's on the fake-quantized input."""
    torch.manual_seed(0)
    x, _ = _data(16)
    engine = get_engine("pt2e")
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8))
    zero = torch.arange(8) % 2 == 0
    with torch.no_grad():
        net[1].weight[zero] = 0
    prepared = engine.prepare(net, Inputs((x[:8],)), QuantSpec(backend="x86"))
    engine.set_phase(prepared, Phase(True, True, False))
    with torch.no_grad():
        prepared(x)  # observed ranges
    engine.set_phase(prepared, Phase(True, False, False))  # observers off: the reference sees the same quantizers
    # a copy made while the gammas are 0 (the fit-end fake-quant copy, Lightning's SWA) decompiles and converts
    copied = copy.deepcopy(prepared)
    engine.decompile(copied)
    with torch.no_grad():
        assert torch.isfinite(copied(x)).all()
        assert torch.isfinite(engine.convert(copied, QuantSpec(backend="x86"))(x)).all()
    inputs = []
    first = next(m for name, m in prepared.named_modules() if name == "activation_post_process_0")
    first.register_forward_hook(lambda module, args, output: inputs.append(output.detach()))
    if path == "compiled":
        torch._dynamo.reset()
        assert engine.compile_training(prepared, backend="aot_eager")
    prepared.train()
    out = prepared(x)
    dy = torch.randn_like(out)
    out.backward(dy)
    weight, bias = dict(prepared.named_parameters())["0.weight"], dict(prepared.named_parameters())["0.bias"]
    gamma_param, beta = dict(prepared.named_parameters())["1.weight"], dict(prepared.named_parameters())["1.bias"]
    gamma = gamma_param.detach().clone().requires_grad_(True)
    expected = torch.nn.functional.batch_norm(
        torch.nn.functional.conv2d(inputs[-1], weight.detach(), bias.detach(), padding=1), None, None, gamma,
        beta.detach(), training=True, eps=1e-5)
    expected.backward(dy)
    assert torch.isfinite(out).all() and torch.isfinite(weight.grad).all()
    torch.testing.assert_close(out[:, zero], beta.detach()[zero].reshape(1, -1, 1, 1).expand_as(out[:, zero]))
    torch.testing.assert_close(gamma_param.grad[zero], gamma.grad[zero], rtol=1e-4, atol=1e-6)
    assert bool((gamma_param.grad[zero] != 0).all())
    engine.decompile(prepared)
    int8 = engine.convert(prepared, QuantSpec(backend="x86"))
    with torch.no_grad():
        assert torch.isfinite(int8(x)).all()
