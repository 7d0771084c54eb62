"""lowering=auto: the choice logic (with fake candidates and a fake timer) and real parity on digits.

No timing assertions: which runtime is fastest depends on the machine. The tests check that the
fastest *eligible* candidate is kept, that parity breaches and build failures disqualify, that the
fallback is kept when nothing else qualifies, and that the real runtimes reproduce the fake-quant model.
"""

from __future__ import annotations

import copy
import itertools
import pickle
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.core.inputs import rebatch
from qlightning.examples.digits import DigitsCNN, DigitsDataModule
from qlightning.quantize.lowering import (
    BUILDERS,
    InductorModule,
    LoweringChoice,
    OnnxRuntimeModule,
    choose_lowering,
    reference_qdq_module,
    source_of,
)
from qlightning.run.parity import sqnr_db, top1_agreement


# ---------------------------------------------------------------------------------------------- fakes


class Scaled(nn.Module):
    """``x @ w * gain + noise``: a stand-in runtime whose output differs from the reference by a known amount."""

    def __init__(self, w: torch.Tensor, noise: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        self.w, self.noise, self.seed = w, noise, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.w
        if self.noise:
            g = torch.Generator().manual_seed(self.seed)
            out = out + self.noise * out.std() * torch.randn(out.shape, generator=g)
        return out


@pytest.fixture()
def toy():
    torch.manual_seed(0)
    w = torch.randn(16, 10)
    x = torch.randn(64, 16)
    return Scaled(w), Scaled(w, noise=0.0005, seed=1), x, w


def fixed_timer(ms: dict[str, float]):
    def timer(fns):
        for fn in fns.values():
            fn()  # every candidate still runs
        return {name: ms[name] for name in fns}

    return timer


def builders(w: torch.Tensor, **noise: float):
    return {name: (lambda ctx, n=level, s=i: Scaled(w, noise=n, seed=s + 2)) for i, (name, level) in enumerate(noise.items())}


# ---------------------------------------------------------------------------------------------- choice logic


def test_fastest_eligible_candidate_wins(toy):
    reference, int8, x, w = toy
    choice = choose_lowering(
        reference, int8, x, candidates=("fx", "fast", "faster"),
        builders=builders(w, fast=0.001, faster=0.002), timer=fixed_timer({"fx": 3.0, "fast": 2.0, "faster": 1.0}),
    )
    assert choice.name == "faster"
    assert choice.latency_ms == {"fx": 3.0, "fast": 2.0, "faster": 1.0}
    assert set(choice.sqnr_db) == {"fx", "fast", "faster"} and all(v > 30 for v in choice.sqnr_db.values())
    assert choice.errors == {}
    assert choice.speedup_over("fx") == pytest.approx(3.0)
    with torch.no_grad():
        assert torch.allclose(choice.module(x), Scaled(w, 0.002, 3)(x))


def test_parity_breach_disqualifies_the_fastest(toy):
    reference, int8, x, w = toy
    choice = choose_lowering(
        reference, int8, x, candidates=("fx", "sloppy", "ok"), tolerance_db=None,
        builders=builders(w, sloppy=0.5, ok=0.001), timer=fixed_timer({"fx": 3.0, "sloppy": 0.5, "ok": 2.0}),
    )
    assert choice.name == "ok"
    assert "sloppy" in choice.errors and "SQNR" in choice.errors["sloppy"]
    assert choice.sqnr_db["sloppy"] < 25 <= choice.sqnr_db["ok"]
    assert choice.passed == ["fx", "ok"]


def test_top1_threshold(toy):
    reference, int8, x, w = toy
    choice = choose_lowering(
        reference, int8, x, candidates=("fx", "noisy"), min_sqnr_db=0.0, min_top1=0.999, tolerance_db=None,
        builders=builders(w, noisy=0.3), timer=fixed_timer({"fx": 2.0, "noisy": 1.0}),
    )
    assert choice.top1_agreement["noisy"] < 0.999
    assert "top-1" in choice.errors["noisy"]
    assert choice.name == "fx"


def test_build_failure_is_recorded_not_raised(toy):
    reference, int8, x, w = toy

    def broken(ctx):
        raise RuntimeError("no such runtime here")

    choice = choose_lowering(reference, int8, x, candidates=("fx", "broken"), builders={"broken": broken},
                             timer=fixed_timer({"fx": 1.0}))
    assert choice.name == "fx"
    assert "no such runtime here" in choice.errors["broken"]
    assert choice.latency_ms["broken"] is None


def test_fallback_kept_when_nothing_passes(toy):
    reference, _, x, w = toy
    int8 = Scaled(w, noise=0.5, seed=9)  # the engine's own module is far off too
    choice = choose_lowering(
        reference, int8, x, candidates=("fx", "other"), tolerance_db=None,
        builders=builders(w, other=0.6), timer=fixed_timer({"fx": 2.0, "other": 1.0}),
    )
    assert choice.name == "fx" and choice.module is int8
    assert set(choice.errors) == {"fx", "other"}


def test_relative_tolerance_accepts_candidates_as_faithful_as_the_fallback(toy):
    reference, _, x, w = toy
    int8 = Scaled(w, noise=0.2, seed=9)  # ~14 dB: below the absolute threshold
    choice = choose_lowering(
        reference, int8, x, candidates=("fx", "same", "worse"),
        builders={"same": lambda ctx: Scaled(w, noise=0.2, seed=9), **builders(w, worse=0.6)},
        timer=fixed_timer({"fx": 3.0, "same": 1.0, "worse": 0.5}),
    )
    assert abs(choice.sqnr_db["same"] - choice.sqnr_db["fx"]) < 1.0
    assert "worse" in choice.errors and "same" not in choice.errors and "fx" not in choice.errors
    assert choice.name == "same"


def test_relative_tolerance_allows_top1_sampling_noise_but_not_a_real_drop():
    """CI (stop 19): MiniLM's inductor int8 encoder was closer to fake-quant than the eager one (13.7 vs 12.9
    dB) yet refused, its top-1 agreement over ~120 token rows 0.773 against fx's ~0.79: a one-point
    tolerance is below what 120 rows can resolve. Two standard errors (here 7.5 points) are allowed; a
    real drop is still refused."""
    from qlightning.quantize.lowering import _parity_problems

    def choice(candidate_top1: float) -> LoweringChoice:
        return LoweringChoice(
            name="fx", module=nn.Identity(), sqnr_db={"fx": 12.89, "inductor": 13.66},
            top1_agreement={"fx": 0.79, "inductor": candidate_top1}, top1_rows={"fx": 120, "inductor": 120},
        )

    assert _parity_problems(choice(0.773), "inductor", "fx", tolerance_db=1.0) == []
    assert _parity_problems(choice(0.70), "inductor", "fx", tolerance_db=1.0)  # 9 points: not noise
    # on many rows the same 1.7-point gap is real
    many = choice(0.773)
    many.top1_rows = {"fx": 100_000, "inductor": 100_000}
    assert _parity_problems(many, "inductor", "fx", tolerance_db=1.0)


def test_fallback_is_always_a_candidate_and_unknown_names_fail(toy):
    reference, int8, x, w = toy
    choice = choose_lowering(reference, int8, x, candidates=("only",), builders=builders(w, only=0.001),
                             timer=fixed_timer({"fx": 2.0, "only": 1.0}))
    assert set(choice.latency_ms) == {"fx", "only"} and choice.name == "only"
    with pytest.raises(ValueError, match="unknown candidate"):
        choose_lowering(reference, int8, x, candidates=("fx", "tpu"))


class CompilesOnFirstCall(Scaled):
    """Stands in for a compiled runtime: the first call "compiles", and remembers which input it saw."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__(w)
        self.calls: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return super().forward(x)


def test_latency_is_not_what_the_previous_runtimes_threads_cost(monkeypatch):
    """onnxruntime's and OpenMP's worker threads spin-wait after a call and slow whatever runs next on a small
    machine: timed call by call, alternating runtimes, each paid for the other (a float ResNet-18 read 98 ms
    against 26 ms, torch 2.14.1 on 2 cores). A fake clock: each call costs its own time, plus 4 ms right
    after the other runtime's call."""
    import qlightning.core.metrics as metrics

    clock = {"now": 0.0, "last": None}

    def call(name: str, cost_ms: float):
        def fn() -> None:
            clock["now"] += (cost_ms + (4.0 if clock["last"] not in (None, name) else 0.0)) / 1e3
            clock["last"] = name
        return fn

    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["now"])
    ms = metrics.median_ms({"onnxruntime": call("onnxruntime", 1.0), "fx": call("fx", 2.0)}, repeats=12, warmup=2)
    assert ms == pytest.approx({"onnxruntime": 1.0, "fx": 2.0})

    # python -m benchmarks times the runtimes (and float eager beside them) the same way
    from benchmarks import timing

    monkeypatch.setitem(timing.CLOCKS, "wall", lambda: clock["now"])
    stats = timing.blocked_medians({"onnxruntime": call("onnxruntime", 1.0), "float": call("float", 5.0)}, repeats=12)
    assert timing.medians(stats) == pytest.approx({"onnxruntime": 1e-3, "float": 5e-3})


def test_first_call_is_recorded_apart_from_build_and_latency(toy):
    reference, int8, x, w = toy
    built = {}

    def lazy(ctx):
        built["module"] = CompilesOnFirstCall(w)
        return built["module"]

    def broken(ctx):
        raise RuntimeError("cannot build")

    choice = choose_lowering(reference, int8, x, candidates=("fx", "lazy", "broken"),
                             builders={"lazy": lazy, "broken": broken}, timer=fixed_timer({"fx": 2.0, "lazy": 1.0}))
    assert set(choice.first_call_s) == {"fx", "lazy"} and set(choice.build_s) == {"fx", "lazy", "broken"}
    assert all(v >= 0 for v in choice.first_call_s.values())
    # the first call is on the example input, before the parity check and the timing runs
    assert built["module"].calls[0] == x.shape[0] and len(built["module"].calls) >= 3
    assert "first_call_s" in choice.to_dict() and choice.name == "lazy"


class KeywordScaled(Scaled):
    def forward(self, x: torch.Tensor, *, gain: torch.Tensor) -> torch.Tensor:  # keyword-only, like input_ids=
        return super().forward(x) * gain


def test_keyword_inputs_reach_the_candidates(toy):
    _, _, x, w = toy
    reference, int8 = KeywordScaled(w), KeywordScaled(w, noise=0.0005, seed=1)
    gain = torch.full((1,), 2.0)
    choice = choose_lowering(reference, int8, Inputs((x,), {"gain": gain}), candidates=("fx", "other"),
                             builders={"other": lambda ctx: KeywordScaled(w, noise=0.001, seed=2)},
                             timer=fixed_timer({"fx": 2.0, "other": 1.0}))
    assert choice.errors == {} and choice.name == "other" and choice.sqnr_db["other"] > 30
    assert choice.batch_size == x.shape[0]


def test_reference_never_observes(toy):
    """The fake-quant model is run on a copy: its observers (and any state) never move."""
    _, int8, x, w = toy
    net = DigitsCNN()
    engine = get_engine("fx")
    prepared = engine.prepare(net, Inputs((torch.zeros(1, 1, 8, 8),)), QuantSpec(backend="x86"))
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    before = {k: v.clone() for k, v in prepared.state_dict().items()}
    images = torch.rand(8, 1, 8, 8)
    int8 = copy.deepcopy(prepared)
    engine.set_observers(int8, False)
    choose_lowering(prepared, int8, images, candidates=("fx",), timer=fixed_timer({"fx": 1.0}))
    after = prepared.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_to_dict_is_plain_data(toy):
    reference, int8, x, w = toy
    choice = choose_lowering(reference, int8, x, candidates=("fx",), timer=fixed_timer({"fx": 1.0}))
    data = choice.to_dict()
    assert "module" not in data and data["name"] == "fx" and data["passed"] == ["fx"]
    import json

    json.dumps(data)


# ---------------------------------------------------------------------------------------------- real runtimes


@pytest.fixture(scope="module")
def trained_digits():
    """A digits CNN QAT-trained for a few epochs with the FX engine, converted; plus held-out images."""
    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x, y = dm.splits["train"].tensors
    engine, spec = get_engine("fx"), QuantSpec(backend="x86")
    net = DigitsCNN()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for epoch in range(4):  # float warm-up
        for i in range(0, len(x), 64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[i:i + 64]), y[i:i + 64]).backward()
            optimizer.step()
    prepared = engine.prepare(net, Inputs((x[:1],)), spec)
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    optimizer = torch.optim.Adam(prepared.parameters(), lr=2e-3)
    for epoch in range(2):
        for i in range(0, len(x), 64):
            optimizer.zero_grad()
            nn.functional.cross_entropy(prepared(x[i:i + 64]), y[i:i + 64]).backward()
            optimizer.step()
    engine.set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=True))
    fake_quant = copy.deepcopy(prepared).eval()
    int8 = engine.convert(prepared, spec)
    test_x, test_y = dm.splits["test"].tensors
    return fake_quant, int8, test_x[:64], test_y[:64]


def test_onnxruntime_candidate_is_faithful(trained_digits):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    fake_quant, int8, x, y = trained_digits
    choice = choose_lowering(fake_quant, int8, x, candidates=("fx", "onnxruntime"), repeats=3, warmup=1)
    assert "onnxruntime" not in choice.errors, choice.errors
    assert "fx" not in choice.errors, choice.errors
    for name in ("fx", "onnxruntime"):
        assert choice.sqnr_db[name] >= 25.0
        assert choice.top1_agreement[name] >= 0.99
        assert choice.latency_ms[name] is not None and choice.latency_ms[name] > 0
    assert choice.name in ("fx", "onnxruntime")
    assert choice.name == min(choice.passed, key=lambda n: choice.latency_ms[n])
    # the kept module is what was measured, and it classifies like the fake-quant model
    with torch.no_grad():
        out, ref = choice.module(x), fake_quant(x)
    assert sqnr_db(ref, out) >= 25.0 and top1_agreement(ref, out) >= 0.99
    assert source_of(choice.module) is int8


def test_onnxruntime_module_survives_copy_and_pickle(trained_digits):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    fake_quant, int8, x, _ = trained_digits
    choice = choose_lowering(fake_quant, int8, x, candidates=("onnxruntime",), repeats=1, warmup=0)
    module = BUILDERS["onnxruntime"](_context(fake_quant, int8, x)) if choice.name != "onnxruntime" else choice.module
    assert isinstance(module, OnnxRuntimeModule)
    with torch.no_grad():
        expected = module(x)
        assert torch.equal(copy.deepcopy(module)(x), expected)
        assert torch.equal(pickle.loads(pickle.dumps(module))(x), expected)
    assert "onnx_model" in module.state_dict() and module.state_dict()["onnx_model"].dtype == torch.uint8


def test_onnxruntime_runs_the_convolutions_of_a_reduce_range_model_as_int8_kernels(trained_digits, tmp_path):
    """x86 trains activations in 0..127 (reduce_range) and ONNX QuantizeLinear cannot say so: the export clamps
    explicitly. A clamp between a conv and its quantize kept onnxruntime from fusing DequantizeLinear -> Conv
    -> QuantizeLinear into QLinearConv, so every conv ran in float (digits CNN: 2x slower than fused)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import onnx

    fake_quant, int8, x, _ = trained_digits
    module = BUILDERS["onnxruntime"](_context(fake_quant, int8, x))
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(module.onnx_model.numpy().tobytes(), options, providers=["CPUExecutionProvider"])
    ops = [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]
    convs = sum(isinstance(m, nn.Conv2d) for m in DigitsCNN().modules())
    assert ops.count("QLinearConv") == convs, ops
    assert not {"Conv", "FusedConv"} & set(ops), ops
    with torch.no_grad():
        assert sqnr_db(int8(x), module(x)) >= 35.0  # still the int8 model's numbers, clamps included


def test_the_artifact_manifest_gives_each_activation_once_with_the_range_it_trained_to(trained_digits):
    """The manifest's qparams (``qparams_summary``) read through the explicit clamps: one entry per
    activation, named after the layer producing it, with x86's reduce_range 0..127 (it listed each twice,
    after anonymous ``clamp`` nodes, as 0..255)."""
    from qlightning.quantize.qdq import qparams_summary

    fake_quant, int8, x, _ = trained_digits
    activations = qparams_summary(_context(fake_quant, int8, x).qdq_program().program)["activations"]
    after = [a["after"] for a in activations]
    assert len(after) == len(set(after)) and not any(name.startswith("clamp") for name in after), after
    assert "features.0.0" in after and "classifier" in after, after
    assert {(a["quant_min"], a["quant_max"]) for a in activations} == {(0, 127)}, activations


def _context(fake_quant, int8, x):
    from qlightning.quantize.lowering import LoweringContext

    return LoweringContext(fake_quant, int8, Inputs((x,)))


def test_reference_qdq_module_matches_int8(trained_digits):
    fake_quant, int8, x, _ = trained_digits
    reference = reference_qdq_module(fake_quant, int8)
    with torch.no_grad():
        assert sqnr_db(int8(x), reference(x)) >= 30.0


def test_parity_inputs_extend_the_check(trained_digits):
    fake_quant, int8, x, _ = trained_digits
    choice = choose_lowering(fake_quant, int8, x[:1], candidates=("fx",), parity_inputs=[x[i:i + 1] for i in range(32)],
                             timer=fixed_timer({"fx": 1.0}))
    assert choice.top1_agreement["fx"] is not None and choice.top1_agreement["fx"] >= 0.95
    assert choice.batch_size == 1


@pytest.mark.slow
def test_inductor_candidate_is_faithful(trained_digits):
    fake_quant, int8, x, y = trained_digits
    choice = choose_lowering(fake_quant, int8, x, candidates=("fx", "inductor"), repeats=3, warmup=1)
    assert "inductor" not in choice.errors, choice.errors
    assert choice.sqnr_db["inductor"] >= 25.0 and choice.top1_agreement["inductor"] >= 0.99
    module = choice.module if choice.name == "inductor" else None
    if module is not None:
        assert isinstance(module, InductorModule)


@pytest.mark.slow
def test_inductor_module_compiles_once_for_a_shape_whether_or_not_under_inference_mode(trained_digits):
    """Lightning validates and tests under ``torch.inference_mode``; the lowering times the module under
    ``no_grad``. Dynamo guards on each input's dispatch keys, which the mode changes: the same batch shape
    compiled again for each mix (MiniLM's encoder: six inductor compiles in one recipe run)."""
    from torch._dynamo.utils import counters

    fake_quant, int8, x, _ = trained_digits
    module = BUILDERS["inductor"](_context(fake_quant, int8, x[:32]))
    before = counters["stats"]["unique_graphs"]
    outs = []
    for mode in (torch.no_grad, torch.inference_mode, torch.inference_mode, torch.no_grad):
        with mode():
            batch = x[:32].clone()  # under inference_mode: an inference tensor, as Lightning's batches are
            outs.append(module(batch))
    assert counters["stats"]["unique_graphs"] - before == 1
    assert all(torch.equal(out, outs[0]) for out in outs)
    # its parameters are not guarded (frozen in), its inputs are: another batch size compiles again, right
    with torch.no_grad():
        assert torch.equal(module(x[:8]), outs[0][:8])
    assert counters["stats"]["unique_graphs"] - before == 2


def test_inductor_module_runs_with_the_python_wrapper_when_the_cpp_one_fails_to_compile():
    """``lowering=inductor`` calls its kernels from C++ (``cpp_wrapper``); a graph whose C++ wrapper does not
    compile must still run, with the Python wrapper, not lose the candidate. An error that is not a compile
    failure is raised as it is. (No compile here: the compiled callable is a stand-in that reads the config.)"""
    import torch._inductor.config as inductor_config
    from torch._dynamo.exc import BackendCompilerFailed

    calls = []

    def compiled(x):
        calls.append(inductor_config.cpp_wrapper)
        if inductor_config.cpp_wrapper:
            raise BackendCompilerFailed(None, RuntimeError("C++ compile error"), None)
        return x + 1

    module = InductorModule(nn.Identity())
    module._compiled = compiled
    assert module.wrapper == "cpp"
    assert torch.equal(module(torch.zeros(2)), torch.ones(2))
    assert calls == [True, False] and module.wrapper == "python"
    assert torch.equal(module(torch.zeros(2)), torch.ones(2)) and calls == [True, False, False]

    def broken(x):
        raise ValueError("not a compile failure")

    module = InductorModule(nn.Identity())
    module._compiled = broken
    with pytest.raises(ValueError, match="not a compile failure"):
        module(torch.zeros(2))
    assert module.wrapper == "cpp"


def test_keyword_inputs_bind_to_positions_through_a_lowering_wrapper():
    """The report and parity gate call every runtime with positional inputs; a submodule called with
    keywords (``encoder(input_ids=..., attention_mask=...)``) must bind through the wrapper to the
    engine's module, not into the wrapper's ``**kwargs``."""
    from qlightning.engines.base import Inputs
    from qlightning.core.inputs import attach_source as _attach_source, positional_args

    class Encoder(nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    class Wrapper(nn.Module):
        def forward(self, *args, **kwargs):
            return args

    ids, mask = torch.ones(2, 3), torch.zeros(2, 3)
    bound = positional_args(_attach_source(Wrapper(), Encoder()), Inputs((), {"attention_mask": mask, "input_ids": ids}))
    assert len(bound) == 2 and bound[0] is ids and bound[1] is mask
    with pytest.raises(TypeError, match="cannot bind keyword inputs"):
        positional_args(Wrapper(), Inputs((), {"input_ids": ids}))


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6), rows=st.integers(1, 32), limit=st.integers(1, 5))
def test_held_batches_regroup_into_calls_of_the_timed_shape(sizes, rows, limit):
    """The rows of held batches, in order, as calls of exactly ``rows`` rows (one shape for compiled runtimes)."""
    start = list(itertools.accumulate([0, *sizes]))
    batches = [Inputs((torch.arange(a, b).float().unsqueeze(1), 2.0), {"mask": torch.ones(b - a, 3)})
               for a, b in zip(start, start[1:])]
    batches.append(Inputs((torch.zeros(4, 2), 2.0), {"mask": torch.ones(4, 3)}))  # another feature size: left out
    calls = rebatch(batches, rows, limit=limit)
    total = start[-1]
    assert len(calls) == (1 if total < rows else min(total // rows, limit))
    for k, call in enumerate(calls):
        x, scale = call.args
        assert x.shape == (rows, 1) and call.kwargs["mask"].shape == (rows, 3) and scale == 2.0
        expected = torch.arange(k * rows, (k + 1) * rows) % total if total < rows else torch.arange(k * rows, (k + 1) * rows)
        assert torch.equal(x.squeeze(1), expected.float())


_INT8_KERNELS_SCRIPT = r"""
import copy, json, re, sys, warnings
warnings.simplefilter("ignore")
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.examples.digits import DigitsCNN, DigitsDataModule
from qlightning.quantize import lowering
from qlightning.quantize.lowering import BUILDERS, LoweringContext
from qlightning.run.parity import sqnr_db
# the kernels as they fuse without float_round_trips (tested on its own): on AVX2 a conv feeding a pool writes float32
lowering.uint8_loads_are_slow = lambda: False


class DigitsReLU6(nn.Module):  # MobileNetV2's conv-bn-ReLU6, which torch.ao does not fuse into the conv
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16), nn.ReLU6(),
            nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class DigitsConvNeXt(nn.Module):  # LayerNorm, GELU, layer scale and residual add stay float under FX
    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.act, self.fc2 = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = (self.fc2(self.act(self.fc1(y))) * self.gamma).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


torch.manual_seed(0)
dm = DigitsDataModule(seed=0)
dm.setup()
x = dm.splits["train"].tensors[0][:128]
engine, spec = get_engine("fx"), QuantSpec(backend="x86")
results = {}
for name, net in (("digits_cnn", DigitsCNN()), ("relu6", DigitsReLU6()), ("convnext", DigitsConvNeXt())):
    counters.clear()
    prepared = engine.prepare(net, Inputs((x[:1],)), spec)
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    prepared.train()
    with torch.no_grad():
        for i in range(0, 128, 32):
            prepared(x[i:i + 32])
    engine.set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=True))
    fake_quant = prepared
    int8 = engine.convert(copy.deepcopy(prepared), spec)
    torchao_before = "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer" in sys.modules
    module = BUILDERS["inductor"](LoweringContext(fake_quant, int8, Inputs((x[:32],))))
    module.wrapper = "python"  # its generated code is the one read below; the C++ wrapper calls the same kernels
    with torch.no_grad():
        out, code = run_and_get_code(module, x[:32])
        ref = fake_quant.eval()(x[:32])
    code = "\n".join(code)
    convs = [line for line in code.splitlines()
             if "torch.ops.onednn.qconv_pointwise" in line and "assert" not in line and "=" in line]
    results[name] = {
        "torchao_before": torchao_before, "qconv": counters["inductor"]["qconv_weight_prepack_matcher_count"],
        "qlinear": counters["inductor"]["qlinear_weight_prepack_matcher_count"], "sqnr_db": sqnr_db(ref, out),
        "conv_calls": len(convs), "uint8_hardtanh": sum("torch.uint8, 'hardtanh'" in line for line in convs),
        # elementwise kernels of their own that clamp (a ReLU6 on a conv's uint8 output)
        "hardtanh_kernels": len(set(re.findall(r"cpp_fused\w*hardtanh\w*", code)))}
    # what lowering=inductor runs: the same graph called from C++ (cpp_wrapper), the same outputs
    cpp = BUILDERS["inductor"](LoweringContext(fake_quant, int8, Inputs((x[:32],))))
    with torch.no_grad():
        cpp_out, cpp_code = run_and_get_code(cpp, x[:32])
    results[name].update(wrapper=cpp.wrapper, cpp_equal=torch.equal(cpp_out, out),
                         cpp_qconv_calls="\n".join(cpp_code).count("aoti_torch_cpu__qconv_pointwise"))
print(json.dumps(results))
"""


@pytest.mark.slow
def test_inductor_lowers_an_fx_model_to_int8_kernels_in_a_process_that_never_used_pt2e(tmp_path):
    """From torch 2.14 inductor's x86 int8 passes (q/dq + conv -> oneDNN qconv) are torchao's, registered when
    its x86 quantizer is imported, which only the PT2E engine did: in an FX-only process ``lowering=inductor``
    compiled the q/dq graph into float convolutions (as faithful, at float speed). A fresh interpreter, the
    FX graph cache off (a cached graph skips the passes, and their counters). Also: x86's activation clamps
    reach inductor in the form it fuses into the int8 conv (a conv with a float32 output and a separate
    clamp-and-quantize kernel before), a ReLU6 too (a separate uint8 kernel per conv before). A ConvNeXt block,
    whose clamps after GELU and LayerNorm reach inductor as narrow quantizes, compiles to what its fake-quant model
    computes too (it does not show a dropped narrow range: its activations stay inside their calibrated ranges;
    the quick test of the rewrite does)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    done = subprocess.run([sys.executable, "-c", _INT8_KERNELS_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert not results["digits_cnn"]["torchao_before"], (
        "the FX run imported torchao's x86 quantizer: the test would not see the defect")
    for name, result in results.items():
        assert result["qconv"] >= 2 and result["qlinear"] >= 1, (name, result)  # the convs and head as int8 kernels
        # each conv, its ReLU (ReLU6) and the clamp to x86's 0..127 in one kernel writing uint8 (clamps_before_quantize)
        assert result["conv_calls"] == result["qconv"] == result["uint8_hardtanh"], (name, result)
        assert result["hardtanh_kernels"] == 0, (name, result)  # no ReLU6 left in a kernel of its own
        assert result["sqnr_db"] >= 25.0, (name, result)  # faithful to the fake-quant model (lowering's threshold)
        # the C++ wrapper compiled (no fallback to the Python one), calls every int8 conv, computes the same
        assert result["wrapper"] == "cpp" and result["cpp_equal"], (name, result)
        assert result["cpp_qconv_calls"] == result["conv_calls"], (name, result)


def test_clamps_before_quantize_compute_the_same_integers(trained_digits):
    """The inductor form of x86's activation clamps (``clamp -> quantize`` after each conv, ReLU folded into
    the clamp) computes what the chain ONNX needs (``quantize -> dequantize -> clamp -> quantize``) does, bit for
    bit, in range and far outside it."""
    from qlightning.quantize.qdq import clamps_before_quantize, qdq_program

    fake_quant, int8, x, _ = trained_digits
    program = qdq_program(reference_qdq_module(fake_quant, int8), Inputs((x[:32],)))
    chain, fused = program.program.module(), program.program.module()
    # DigitsCNN's three conv-bn(-relu)s; after the max pool (on the codes since stop 38) and after the flatten, each
    # one's requantize, clamp and requantize on its input's grid (_drop_identity_requantizes, the tests below)
    assert clamps_before_quantize(fused) == 3 + 3 + 3
    targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.relu.default not in targets  # folded into the clamps
    assert torch.ops.aten.relu.default in [n.target for n in chain.graph.nodes]  # a graph of its own
    with torch.no_grad():
        for batch in (x[:32], 8.0 * x[32:64], -x[64:96]):
            assert torch.equal(chain(batch), fused(batch))


def _qdq_graphs_of(net: nn.Module, calibration_scale: float = 1.0,
                   after_calibration: Any = None) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, torch.Tensor]:
    """``net`` FX-prepared for x86, observed on 256 digits (times ``calibration_scale``), converted; two copies of
    its q/dq graph (the chain as exported, and one to rewrite) and the digits."""
    from qlightning.quantize.qdq import qdq_program

    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x = dm.splits["train"].tensors[0][:256]
    engine, spec = get_engine("fx"), QuantSpec(backend="x86")
    prepared = engine.prepare(net, Inputs((x[:1],)), spec)
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    with torch.no_grad():
        for i in range(0, 256, 64):
            prepared(calibration_scale * x[i:i + 64])
    engine.set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=True))
    if after_calibration is not None:
        with torch.no_grad():
            after_calibration(prepared)
    fake_quant = copy.deepcopy(prepared).eval()
    int8 = engine.convert(prepared, spec)
    program = qdq_program(reference_qdq_module(fake_quant, int8), Inputs((x[:32],)))
    return program.program.module(), program.program.module(), x


class DigitsReLU6(nn.Module):
    """MobileNetV2's conv-bn-ReLU6 blocks on digits: torch.ao fuses conv-bn but leaves each ReLU6 on the conv's
    quantized output. BatchNorm scales of 12 put the convs' ranges beyond 6, so the ReLU6's bound is the one that
    applies, between two grid points."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU6())
        # in place, as torchvision's MobileNetV2 has it (the exported graph keeps hardtanh_)
        self.depthwise = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.BatchNorm2d(16),
                                       nn.ReLU6(inplace=True))
        self.pointwise = nn.Sequential(nn.Conv2d(16, 32, 1, bias=False), nn.BatchNorm2d(32))
        self.head = nn.Linear(32, 10)
        for bn in (self.stem[1], self.depthwise[1]):
            nn.init.constant_(bn.weight, 12.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        first = self.stem(x)
        second = self.depthwise(first)
        return self.head(self.pointwise(second).mean((2, 3))), first, second  # the ReLU6s' integers too


def test_relu6_folds_into_the_conv_clamp_with_the_same_integers():
    """A ReLU6 on a conv's quantized output (torch.ao does not fuse it) went to inductor as a separate uint8
    kernel per conv (34 on mobilenet_v2: FX 1.8x float where PT2E, which fuses it, ran 2.9x). It now joins the
    conv's clamp: the same integers as the chain, bit for bit, in range, far outside it and at its ends."""
    from qlightning.quantize.qdq import clamps_before_quantize

    chain, fused, x = _qdq_graphs_of(DigitsReLU6())
    hardtanh = (torch.ops.aten.hardtanh.default, torch.ops.aten.hardtanh_.default)
    assert sum(n.target in hardtanh for n in chain.graph.nodes) == 2
    assert clamps_before_quantize(fused) == 3 + 2  # three convs' clamps, two ReLU6s folded into them
    assert not [n for n in fused.graph.nodes if n.target in hardtanh]
    conv_clamps = [n.args[1:] for n in fused.graph.nodes if n.target is torch.ops.aten.clamp.default
                   and n.args[0].target is torch.ops.aten.conv2d.default]
    assert conv_clamps[:2] == [(0.0, 6.0), (0.0, 6.0)], conv_clamps  # ReLU6's bounds, inside the convs' ranges
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert all(torch.equal(a, b) for a, b in zip(chain(batch), fused(batch)))


class DigitsConvNeXt(nn.Module):
    """A ConvNeXt block on digits (depthwise 7x7, LayerNorm over channels-last, Linear-GELU-Linear, layer scale,
    residual add): under FX the LayerNorm, GELU, scale and add stay float between int8 tensors."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.act, self.fc2 = nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = (self.fc2(self.act(self.fc1(y))) * self.gamma).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


def test_clamp_chains_after_float_ops_become_one_narrow_quantize_with_the_same_integers():
    """After a float op (GELU, LayerNorm and the permute after it) x86's 0..127 clamp chain reaches inductor as
    one narrow-range quantize: bit for bit what the chain computes (timm convnext_atto FX: its kernels
    had read 5x slower than PT2E's)."""
    from qlightning.quantize.qdq import clamps_before_quantize

    # ranges the test batches exceed, and LayerNorm's output (and the GELU's after it) beyond them: clamps apply
    chain, fused, x = _qdq_graphs_of(DigitsConvNeXt(), calibration_scale=0.25,
                                     after_calibration=lambda prepared: prepared.norm.weight.mul_(4.0))
    clamps_before_quantize(fused)
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    narrow = {n.args[0].target for n in fused.graph.nodes if n.target is quantize and n.args[4] < 255}
    # GELU's; LayerNorm's own, or the permute's after it when that permute moved onto the codes
    assert torch.ops.aten.gelu.default in narrow and narrow & {torch.ops.aten.layer_norm.default, torch.ops.aten.permute.default}, narrow
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert torch.equal(chain(batch), fused(batch))


class DigitsConvNeXtDropout(DigitsConvNeXt):
    """The ConvNeXt block with timm Mlp's dropout after the GELU: under FX the dropout requantizes the GELU's codes
    onto the grid it trained (``requantize_as_trained``), then x86's 0..127 clamp chain follows."""

    def __init__(self, c: int = 16) -> None:
        super().__init__(c)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = (self.fc2(self.drop(self.act(self.fc1(y)))) * self.gamma).permute(0, 3, 1, 2)
        return self.head((x + y).mean((2, 3)))


def test_clamp_chain_after_a_requantized_gelu_becomes_a_narrow_requantize_with_the_same_integers():
    """After timm Mlp's GELU -> dropout, the dropout's requantize onto its own grid and x86's clamp chain after it
    compiled into the GELU's kernel as two more round trips (convnext_atto FX's first-stage GELU kernels: 0.40 ms
    against PT2E's 0.16 ms). The chain is one narrow requantize now: bit for bit what it computed (convnext_atto FX
    under inductor 2.17x -> 2.40x float at batch 32, timm vit_tiny FX 1.01x -> 1.12x, outputs equal)."""
    from qlightning.quantize.qdq import clamps_before_quantize

    def shift_dropout_grid(prepared: nn.Module) -> None:  # the dropout's grid apart from the GELU's, as training leaves it
        after_dropout = [n for n in prepared.graph.nodes
                         if n.op == "call_module" and n.args and getattr(n.args[0], "target", None) == "drop"]
        assert after_dropout, "the dropout's output fake-quant"
        prepared.get_submodule(after_dropout[0].target).scale.mul_(1.01)

    chain, fused, x = _qdq_graphs_of(DigitsConvNeXtDropout(), calibration_scale=0.25,
                                     after_calibration=lambda prepared: (prepared.norm.weight.mul_(4.0),
                                                                         shift_dropout_grid(prepared)))
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default

    def requantize_after_dropout(gm: torch.fx.GraphModule) -> torch.fx.Node:
        drop = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default)
        return next(iter(drop.users))

    assert requantize_after_dropout(chain).args[4] == 255  # full range, the clamp chain after it
    clamps_before_quantize(fused)
    tail = requantize_after_dropout(fused)
    assert tail.target is quantize and tail.args[4] < 255, tail.args  # narrow
    after = next(iter(tail.users))
    assert after.target is dequantize and all(u.target is not torch.ops.aten.clamp.default for u in after.users)
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert torch.equal(chain(batch), fused(batch))


def _float_readers_of_codes(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes other than int8 convs, linears and max pools that read a dequantized activation (constants, such as
    the layer scale's int8 copy, inductor folds to float at compile time)."""
    from qlightning.quantize.qdq import _CODE_READERS

    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    return [f"{u.name} ({u.target})" for n in gm.graph.nodes if n.target is dequantize and n.args[0].op != "get_attr"
            for u in n.users if u.target not in _CODE_READERS]


def test_float_ops_read_the_rounded_float_value_not_the_codes_with_the_same_numbers():
    """On AVX2, inductor's CPU kernels load uint8 eight at a time through a 32-byte buffer: convnext_atto FX spent
    twice PT2E's time in its GELU and LayerNorm kernels, which read the convs' uint8 outputs. Where a dequantize feeds
    float ops (LayerNorm, GELU, the layer scale, the residual add), they now get the same rounding done in float32
    (convnext_atto FX under inductor at batch 32: 17.6 -> 10.9 ms, the same outputs): bit for bit the q/dq graph's
    numbers, while every int8 conv and linear still reads dequantized codes (inductor's int8 kernels)."""
    from qlightning.quantize.qdq import clamps_before_quantize, float_round_trips

    chain, fused, x = _qdq_graphs_of(DigitsConvNeXtDropout(), calibration_scale=0.25,
                                     after_calibration=lambda prepared: prepared.norm.weight.mul_(4.0))
    clamps_before_quantize(fused)
    assert _float_readers_of_codes(fused), "the q/dq graph's float ops read dequantized codes"
    assert float_round_trips(fused) >= 4  # the convs' outputs into LayerNorm, GELU, the scale; the residual add
    assert _float_readers_of_codes(fused) == []
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    int8_ops = [n for n in fused.graph.nodes if n.target in (torch.ops.aten.conv2d.default, torch.ops.aten.linear.default)]
    assert len(int8_ops) == 5 and all(n.args[0].target is dequantize for n in int8_ops)
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert torch.equal(chain(batch), fused(batch))


@pytest.mark.parametrize("slow_loads", [True, False])
def test_inductor_candidate_rounds_in_float_only_where_uint8_loads_are_slow(monkeypatch, slow_loads):
    """The inductor candidate gets :func:`float_round_trips` on CPUs without AVX-512 (where the uint8 loads are
    slow), and the graph as it was elsewhere; its graph computes the engine module's q/dq graph either way."""
    from qlightning.quantize import lowering
    from qlightning.quantize.lowering import LoweringContext, _build_inductor

    chain, _, x = _qdq_graphs_of(DigitsConvNeXt(), calibration_scale=0.25)
    monkeypatch.setattr(lowering, "uint8_loads_are_slow", lambda: slow_loads)
    graph = _build_inductor(LoweringContext(chain, chain, Inputs((x[:32],)), qdq_module=chain)).graph  # not called: no compile
    assert (_float_readers_of_codes(graph) == []) == slow_loads
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128]):
            assert torch.equal(chain(batch), graph(batch))


class DigitsShuffle(nn.Module):
    """ShuffleNetV2's unit on digits: split the channels, a branch on one half, concatenate, shuffle the channels
    (view, transpose, contiguous, view) and split again into two convs."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.branch = nn.Sequential(nn.Conv2d(c // 2, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2), nn.ReLU())
        self.left, self.right = nn.Conv2d(c // 2, c, 1), nn.Conv2d(c // 2, c, 1)
        self.mix = nn.Conv2d(c, c, 1)  # reads the shuffled tensor on its own grid (a stride-2 unit's branches do)
        self.head = nn.Linear(c, 10)
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.stem(x).chunk(2, dim=1)
        x = torch.cat((a, self.branch(b)), dim=1)
        x = x.view(-1, 2, self.c // 2, 8, 8).transpose(1, 2).contiguous().view(-1, self.c, 8, 8)
        a, b = x.chunk(2, dim=1)
        return self.head((self.left(a) + self.right(b) + self.mix(x)).mean((2, 3)))


def test_requantizes_that_give_back_their_input_are_dropped_with_the_same_integers():
    """torch.ao FX requantizes after every view, transpose, chunk and concatenation on the same grid, with x86's clamp
    chain after each: inductor compiled shufflenet_v2's channel shuffles into float32 buffers and extra kernels
    (FX 1.6x float, PT2E 1.9x). The pairs and clamps that give back their input exactly go; a requantize onto
    another grid stays, every conv still reads a dequantize (inductor's int8 conv), and the graph computes the same
    integers bit for bit."""
    from qlightning.quantize.qdq import _DATA_MOVEMENT, clamps_before_quantize

    chain, fused, x = _qdq_graphs_of(DigitsShuffle())
    clamps_before_quantize(fused)
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default

    def grid_of(node: Any) -> Any:  # the grid a tensor's values lie on, through data movement and concatenation
        if not isinstance(node, torch.fx.Node):
            return None
        if node.target is dequantize:
            return tuple(node.args[1:3])
        if node.target in _DATA_MOVEMENT:
            return grid_of(node.args[0])
        if node.target is torch.ops.aten.cat.default:
            grids = {grid_of(n) for n in node.args[0]}
            return grids.pop() if len(grids) == 1 else None
        return None

    def requantizes(gm: torch.fx.GraphModule) -> tuple[list[Any], int]:
        """Quantizes of a moved tensor onto its own grid (their dequantizes' users), and onto another grid."""
        same, other = [], 0
        for q in (n for n in gm.graph.nodes if n.target is quantize and isinstance(n.args[0], torch.fx.Node)):
            source = q.args[0]
            if source.target in _DATA_MOVEMENT or source.target is torch.ops.aten.cat.default:
                if grid_of(source) == tuple(q.args[1:3]):
                    same.append({u.target for dq in q.users for u in dq.users})
                else:
                    other += 1
        return same, other

    (same_before, other_before), (same_after, other_after) = requantizes(chain), requantizes(fused)
    assert len(same_before) >= 5, same_before  # the concatenation and the shuffle's view, transpose, contiguous, view
    assert same_after == [], same_after  # ``mix`` reads the codes its input was dequantized from
    assert other_after == other_before >= 2  # onto the convs' grids after the split: kept
    for conv in (n for n in fused.graph.nodes if n.target is torch.ops.aten.conv2d.default):
        assert conv.args[0].target is dequantize, conv  # what inductor turns into an int8 conv
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert torch.equal(chain(batch), fused(batch))


class DigitsMaxPools(nn.Module):
    """ResNet's stem on digits (conv-bn-relu, a 3x3 stride-2 max pool, a conv), then a 7x7 max pool: 49 elements,
    which inductor hands to aten rather than compiling."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.wide = nn.MaxPool2d(7, 1, 3)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.wide(self.conv(self.pool(self.stem(x)))).mean((2, 3)))


def _max_pool_inputs(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.args[0].target for n in gm.graph.nodes if n.target is torch.ops.aten.max_pool2d.default]


def test_max_pools_run_on_the_codes_with_the_same_integers():
    """A max pool between a dequantize and a quantize onto the same grid (torch.ao FX and PT2E both share the grid)
    became torchao's ``quantized::max_pool2d`` under inductor, 168 us on shufflenet_v2's stem at batch 32 against
    19 us for inductor's own kernel on the codes. It now pools the codes (a max commutes with a dequantize): the
    same integers; a window over 25 elements stays as it was (inductor hands it to aten, whose channels-last uint8
    max pool fails)."""
    from qlightning.quantize.qdq import clamps_before_quantize

    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    chain, fused, x = _qdq_graphs_of(DigitsMaxPools())
    assert _max_pool_inputs(chain) == [dequantize, dequantize]
    clamps_before_quantize(fused)
    assert _max_pool_inputs(fused) == [quantize, dequantize]
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192], 0.5 * x[192:256]):
            assert torch.equal(chain(batch), fused(batch))


def test_pt2e_inductor_candidate_pools_the_codes_with_the_same_integers():
    """The PT2E model's graph goes to inductor with the same rewrite (shufflenet_v2 PT2E at batch 32: 2.20x -> 2.33x
    float, resnet18 PT2E 3.91x -> 3.94x, outputs equal)."""
    from qlightning.quantize.lowering import LoweringContext, _build_inductor

    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x = dm.splits["train"].tensors[0][:256]
    engine, spec = get_engine("pt2e"), QuantSpec(backend="x86")
    prepared = engine.prepare(DigitsMaxPools(), Inputs((x[:32],)), spec)
    engine.set_phase(prepared, Phase(fake_quant=True, observe=True, bn_frozen=False))
    with torch.no_grad():
        for i in range(0, 256, 64):
            prepared(x[i:i + 64])
    engine.set_phase(prepared, Phase(fake_quant=True, observe=False, bn_frozen=True))
    int8 = engine.convert(copy.deepcopy(prepared), spec)
    graph = _build_inductor(LoweringContext(prepared, int8, Inputs((x[:32],)))).graph  # compiles on its first call
    quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    assert _max_pool_inputs(int8) == [dequantize, dequantize]
    assert _max_pool_inputs(graph) == [quantize, dequantize]
    with torch.no_grad():
        for batch in (x[:64], 8.0 * x[64:128], -x[128:192]):
            assert torch.equal(int8(batch), graph(batch))


def test_inductor_without_torchao_passes_is_refused_with_the_reason(trained_digits, monkeypatch):
    """On a torch whose inductor has no x86 int8 passes of its own (2.14+) and no torchao, the inductor candidate
    would run float convolutions: it is refused, saying why, and the engine's module is kept."""
    import sys

    from qlightning.engines.pt2e import inductor

    monkeypatch.setattr(inductor, "PASSES_MOVED_TO_TORCHAO", (0, 0))  # any torch: the passes are torchao's
    monkeypatch.setitem(sys.modules, "torchao.quantization.pt2e.quantizer.x86_inductor_quantizer", None)  # not importable
    fake_quant, int8, x, _ = trained_digits
    choice = choose_lowering(fake_quant, int8, x[:32], candidates=("fx", "inductor"), timer=fixed_timer({"fx": 1.0}))
    assert choice.name == "fx"
    assert "torchao" in choice.errors["inductor"] and "float" in choice.errors["inductor"], choice.errors


def test_each_timing_block_starts_after_the_previous_runtime_settles(monkeypatch):
    """``lowering=auto`` times the candidates in blocks taken in turn; onnxruntime's worker threads spin after its
    block and slowed the next one (inductor's mobilenet_v2 FX module read 10.5-11.1 ms there, 4.8 ms without
    onnxruntime among the candidates, and auto kept the slower FX module). Every block starts after a pause."""
    from qlightning.core import metrics

    events: list = []
    monkeypatch.setattr(metrics.time, "sleep", lambda seconds: events.append(seconds))
    fns = {name: (lambda name=name: events.append(name)) for name in ("fx", "onnxruntime", "inductor")}
    times = metrics.block_times(fns, repeats=4, warmup=2, rounds=2, clock=lambda: 0.0)
    assert {name: len(t) for name, t in times.items()} == {"fx": 4, "onnxruntime": 4, "inductor": 4}
    calls = [i for i, e in enumerate(events) if isinstance(e, str)]
    starts = [i for i in calls if i == 0 or events[i - 1] != events[i]]  # the first call of each block
    assert len(starts) == 6  # 3 runtimes x 2 rounds
    assert all(i > 0 and events[i - 1] == 0.05 for i in starts), events


def test_a_metric_that_meets_its_threshold_is_not_held_to_the_fallbacks():
    """Zoo, stop 54 (AVX-512 EPYC): efficientnet_b0 PT2E's inductor module read 42.5 dB and 0.984 top-1 agreement
    against the fake-quant model, the eager q/dq graph (the fallback, shipped anyway) 44.6 dB and 0.984. The
    agreement missed 0.99 in both (near-ties the parity gate warns about), so the candidate was held to the
    fallback on both metrics, and its SQNR, far above 25 dB but 2.1 dB under the fallback's, refused it: ``auto``
    shipped the q/dq graph at 0.67x float instead of inductor at 8x its speed. Each metric is now held to the
    fallback only where it misses its own threshold."""
    from qlightning.quantize.lowering import _parity_problems

    def choice(sqnr: float, top1: float) -> LoweringChoice:
        return LoweringChoice(name="fx", module=nn.Identity(), sqnr_db={"fx": 44.62, "inductor": sqnr},
                              top1_agreement={"fx": 0.9844, "inductor": top1}, top1_rows={"fx": 128, "inductor": 128})

    assert _parity_problems(choice(42.47, 0.9844), "inductor", "fx", tolerance_db=1.0) == []
    # a real drop in agreement is still refused, and so is an SQNR under 25 dB the fallback does not share
    assert _parity_problems(choice(42.47, 0.90), "inductor", "fx", tolerance_db=1.0) == ["top-1 agreement 0.900 < 0.99"]
    assert _parity_problems(choice(20.0, 0.9844), "inductor", "fx", tolerance_db=1.0) == ["SQNR 20.0 dB < 25.0 dB"]
    # thresholds only: both metrics must meet them
    assert _parity_problems(choice(42.47, 0.9844), "inductor", "fx", tolerance_db=None) == ["top-1 agreement 0.984 < 0.99"]
