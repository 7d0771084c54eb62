"""The measurements behind ``python -m benchmarks``: one function per figure family.

Every ratio comes from one :func:`benchmarks.timing.interleaved_medians` call (same process, calls
interleaved, medians), or for int8 runtimes with their own thread pools one
:func:`benchmarks.timing.blocked_medians` call (blocks of calls taken in turn), so the numerator and
denominator saw the same machine state.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from benchmarks.models import ConvBnReluChain, ModelSpec, model_spec
from benchmarks.timing import blocked_medians, interleaved_medians, medians
from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.core.schedule import AutoSchedule

ROOT = str(Path(__file__).resolve().parents[1])  # the repository root, for the child processes
QAT_ON = Phase(fake_quant=True, observe=True, bn_frozen=False)
QAT_FROZEN = Phase(fake_quant=True, observe=False, bn_frozen=True)
#: the default schedule's first half: float, activation observers calibrating (``Schedule.phase``)
WARM_UP = AutoSchedule().resolve(100).phase(0, 0)


@contextlib.contextmanager
def quiet() -> Any:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _log(msg: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- builders


def torchao_fx_prepare(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """The plain torch.ao baseline: ``prepare_qat_fx`` with the x86 default QAT mapping, nothing else."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    torch.backends.quantized.engine = "x86"
    with quiet():
        return prepare_qat_fx(model.train(), get_default_qat_qconfig_mapping("x86"), (example,),
                              backend_config=get_x86_backend_config())


def qlightning_prepare(model: nn.Module, example: torch.Tensor, engine: str = "fx", fast: bool = True) -> nn.Module:
    """qlightning's engine as a user gets it; ``fast=False`` turns the FX engine's fast fake-quant path
    (``qlightning/engines/fast_fq.py``, ``engine_options={"fast_qat": False}``) off."""
    eng = get_engine(engine)
    with quiet():
        batch = example if engine == "fx" else example.repeat(2, *[1] * (example.dim() - 1))
        return eng.prepare(model, Inputs((batch,)), QuantSpec(backend="x86", options={"fast_qat": fast}))


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """Forward + cross-entropy + backward + Adam step (the Lightning training step, minus Lightning)."""
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def set_phase(model: nn.Module, phase: Phase, engine: str = "fx") -> nn.Module:
    get_engine(engine).set_phase(model, phase)
    return model


# ---------------------------------------------------------------------------------------------- QAT step


def qat_step_ratios(spec: ModelSpec, repeats: int, clock: str, pt2e: bool = True) -> dict[str, Any]:
    """QAT train step / float train step for every code path, in one interleaved run."""
    torch.manual_seed(0)
    float_model = spec.build()
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    example = x[:1]
    variants: dict[str, nn.Module] = {"float": float_model}
    variants["torch.ao FX"] = set_phase(torchao_fx_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["qlightning FX, fast path off"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example, fast=False), QAT_ON)
    variants["qlightning FX"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["qlightning FX, float warm-up"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), WARM_UP)
    frozen = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON)
    with torch.no_grad():
        frozen(x)  # observers calibrated once, then frozen (the late QAT phase)
    variants["qlightning FX, observers+BN frozen"] = set_phase(frozen, Phase(True, False, True))
    if pt2e:
        try:
            variants["qlightning PT2E"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example, "pt2e"), QAT_ON, "pt2e")
        except Exception as exc:  # pragma: no cover - depends on torchao
            _log(f"{spec.name}: PT2E prepare failed: {type(exc).__name__}: {exc}")
    fns = {name: train_step(m, x, y) for name, m in variants.items()}
    return _step_figures(spec, interleaved_medians(fns, repeats, warmup=3, clock=clock), repeats)


def step_ratios_by_batch(spec: ModelSpec, batch: int, repeats: int, clock: str) -> dict[str, Any]:
    """QAT train step / float train step at ``batch``, observing and frozen, torch.ao FX's and qlightning FX's, in
    one interleaved run (issue 18's batch 1 / 32 / 64: per-module Python weighs most at batch 1)."""
    torch.manual_seed(0)
    float_model = spec.build()
    x, y = spec.inputs(max(batch, 2)), spec.labels(max(batch, 2))
    x, y = x[:batch], y[:batch]
    example = x[:1]

    def frozen(module: nn.Module, engine_phase: Callable[[nn.Module, Phase], nn.Module]) -> nn.Module:
        with torch.no_grad():
            module(spec.inputs(max(batch, 8)))  # observers calibrated once, then frozen (the late QAT phase)
        return engine_phase(module, QAT_FROZEN)

    variants: dict[str, nn.Module] = {"float": float_model}
    variants["torch.ao FX"] = set_phase(torchao_fx_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["torch.ao FX, frozen"] = frozen(set_phase(torchao_fx_prepare(copy.deepcopy(float_model), example), QAT_ON),
                                             _torchao_frozen)
    variants["qlightning FX"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["qlightning FX, frozen"] = frozen(set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON),
                                               set_phase)
    fns = {name: train_step(m, x, y) for name, m in variants.items()}
    figures = _step_figures(spec, interleaved_medians(fns, repeats, warmup=3, clock=clock), repeats)
    figures["batch"] = batch
    return figures


def _torchao_frozen(module: nn.Module, phase: Phase) -> nn.Module:
    """torch.ao's own late-QAT switches (its tutorial's): observers off, BatchNorm statistics frozen."""
    from torch.ao.nn.intrinsic.qat import freeze_bn_stats
    from torch.ao.quantization import disable_observer

    assert not phase.observe and phase.bn_frozen and phase.fake_quant
    module.apply(disable_observer)
    module.apply(freeze_bn_stats)
    return module


def _step_figures(spec: ModelSpec, stats: dict[str, dict[str, float]], repeats: int) -> dict[str, Any]:
    """Step medians, each over the float step, and quartiles, from one interleaved run."""
    med = medians(stats)
    return {
        "batch": spec.train_batch,
        "step_ms": {k: round(v * 1e3, 3) for k, v in med.items()},
        "over_float": {k: round(v / med["float"], 3) for k, v in med.items() if k != "float"},
        "iqr_ms": {k: [round(s["q1"] * 1e3, 3), round(s["q3"] * 1e3, 3)] for k, s in stats.items()},
        "repeats": repeats,
    }


def compiled_step_ratios(spec: ModelSpec, repeats: int, clock: str, engines: tuple[str, ...] = ("fx",),
                         inductor_defaults: bool = False) -> dict[str, Any]:
    """The compiled QAT path (``engine_options.compile``) beside eager float, compiled float and the eager paths.

    Observing (fake-quant and observers on) and frozen (observers and BN frozen) phases; each compiled variant's
    first two calls (the compile: forward + backward graphs) are timed on the wall clock and reported apart.
    ``engines`` with ``pt2e``: the PT2E engine's eager and compiled paths too. ``inductor_defaults``: also the FX
    compiled path with inductor's default options (its wrapper's size asserts on, as before stop 52), side by side.
    """
    from qlightning.engines.fx.compiled import compile_for_training

    torch.manual_seed(0)
    float_model = spec.build()
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    example = x[:1]

    def frozen(module: nn.Module, engine: str = "fx") -> nn.Module:
        with torch.no_grad():
            module(x)  # observers calibrated once, then frozen (the late QAT phase)
        return set_phase(module, QAT_FROZEN, engine)

    variants: dict[str, nn.Module] = {"float": float_model}
    compiled_float = copy.deepcopy(float_model)
    compiled_float.compile()
    variants["float, compiled"] = compiled_float
    variants["torch.ao FX"] = set_phase(torchao_fx_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["qlightning FX"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON)
    variants["qlightning FX, float warm-up"] = set_phase(qlightning_prepare(copy.deepcopy(float_model), example), WARM_UP)
    variants["qlightning FX, frozen"] = frozen(set_phase(qlightning_prepare(copy.deepcopy(float_model), example), QAT_ON))
    arms = {"": {}, ", inductor defaults": {"options": {"size_asserts": True}}} if inductor_defaults else {"": {}}
    for suffix, compile_kwargs in arms.items():
        for label, frozen_phase in (("qlightning FX compiled", False), ("qlightning FX compiled, frozen", True)):
            module = set_phase(qlightning_prepare(copy.deepcopy(float_model), example, fast=False), QAT_ON)
            compile_for_training(module, **compile_kwargs)
            variants[label + suffix] = frozen(module) if frozen_phase else module
    if "pt2e" in engines:
        def pt2e_prepared() -> nn.Module:
            return set_phase(qlightning_prepare(copy.deepcopy(float_model), example, "pt2e"), QAT_ON, "pt2e")

        variants["qlightning PT2E"] = pt2e_prepared()
        variants["qlightning PT2E, frozen"] = frozen(pt2e_prepared(), "pt2e")
        for label, frozen_phase in (("qlightning PT2E compiled", False), ("qlightning PT2E compiled, frozen", True)):
            module = pt2e_prepared()
            get_engine("pt2e").compile_training(module)
            variants[label] = frozen(module, "pt2e") if frozen_phase else module
    fns = {name: train_step(m, x, y) for name, m in variants.items()}
    compile_s = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn()
        fn()
        if "compiled" in name:
            compile_s[name] = round(time.perf_counter() - start, 1)
    figures = _step_figures(spec, interleaved_medians(fns, repeats, warmup=3, clock=clock), repeats)
    step = figures["step_ms"]
    figures["over_compiled_float"] = {k: round(v / step["float, compiled"], 3) for k, v in step.items()
                                      if "compiled" in k and k != "float, compiled"}
    figures["first_two_steps_s"] = compile_s
    # an epoch's last, smaller batch (two thirds of the batch, at least 16: convolutions guard on a batch of 16)
    last = max(16, spec.train_batch * 2 // 3)
    last_batch_s = {}
    for name, module in variants.items():
        if "compiled" in name and name != "float, compiled" and last < spec.train_batch:
            start = time.perf_counter()
            train_step(module, x[:last], y[:last])()
            last_batch_s[name] = round(time.perf_counter() - start, 2)
    figures["last_batch"] = {"batch": last, "first_step_s": last_batch_s}
    return figures


FIT_MODELS = ("digits_cnn", "residual_depthwise")


def _child_result(code: str, *args: str, timeout: float, **env: str) -> tuple[Optional[str], str]:
    """Run ``code`` in a new Python process (this repository importable, ``env`` added to the environment);
    returns the text after its ``RESULT `` line (``None`` when it printed none) and its error output."""
    full_env = dict(os.environ, **env, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env, timeout=timeout)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    return (None if line is None else line[len("RESULT "):]), (proc.stderr or proc.stdout)[-3000:]


FIT_VARIANTS = {
    "float": None,
    "QAT, defaults": {},
    "QAT, compile=on": {"engine_options": {"compile": "on"}},
    "QAT PT2E, defaults": {"engine": "pt2e"},
    "QAT PT2E, compile=on": {"engine": "pt2e", "engine_options": {"compile": "on"}},
}


def one_fit(model: str, epochs: int, variant: str) -> tuple[float, float]:
    """One ``Trainer.fit`` of ``model`` on digits for ``epochs`` epochs, as a user's default Trainer runs it
    (its default logger, in a temporary directory; no progress bar or checkpoints), with the callback's
    ``variant`` (:data:`FIT_VARIANTS`); returns the wall and process CPU seconds of ``trainer.fit``."""
    import tempfile

    import lightning.pytorch as pl

    from qlightning import QuantizationAwareTraining
    from qlightning.examples import DigitsClassifier, DigitsDataModule
    from qlightning.examples.digits import ClassifierModule, ResidualDepthwiseCNN

    builders = {"digits_cnn": DigitsClassifier, "residual_depthwise": lambda: ClassifierModule(ResidualDepthwiseCNN())}
    kwargs = FIT_VARIANTS[variant]
    pl.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as root:
        callbacks = [] if kwargs is None else [QuantizationAwareTraining(modules=["net"], **kwargs)]
        trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, default_root_dir=root, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
        start, cpu = time.perf_counter(), time.process_time()
        with quiet():
            trainer.fit(builders[model](), datamodule=DigitsDataModule(seed=0))
        return time.perf_counter() - start, time.process_time() - cpu


_FIT_CHILD = """
import json, sys, torch
torch.set_num_threads(int(sys.argv[4]))
from benchmarks.suites import one_fit
print("RESULT " + json.dumps(one_fit(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
"""


def _fit_in_fresh_process(model: str, epochs: int, variant: str) -> tuple[float, float]:
    result, error = _child_result(_FIT_CHILD, model, str(epochs), variant, str(torch.get_num_threads()), timeout=3600)
    if result is None:
        raise RuntimeError(f"fit {model} {epochs} {variant} failed:\n{error}")
    wall, cpu = json.loads(result)
    return wall, cpu


def fit_wall_times(epochs: tuple[int, ...] = (3, 10, 30), repeats: int = 3, models: tuple[str, ...] = FIT_MODELS,
                   compile_from_epochs: int = 30, fresh_process: bool = True,
                   engines: tuple[str, ...] = ("fx",)) -> dict[str, Any]:
    """Wall time of a whole ``Trainer.fit`` on digits: float, with the callback's defaults, and (for fits of at
    least ``compile_from_epochs`` epochs) with ``engine_options.compile=on``; each QAT fit over the float fit of
    the same length (medians of ``repeats``, variants interleaved), on the wall clock and in process CPU time.
    The Trainer is a user's default one (:func:`one_fit`): set-up, logging, validation, conversion and the
    fidelity check at fit end are all in it.

    Args:
        epochs: fit lengths (20 optimizer steps an epoch).
        repeats: fits per variant and length.
        models: ``digits_cnn`` (the embedded default model) and/or ``residual_depthwise``
            (:class:`~qlightning.examples.digits.ResidualDepthwiseCNN`, the issue's "small residual depthwise net").
        compile_from_epochs: the shortest fit that also runs ``compile=on``.
        fresh_process: each fit in a new Python process (torch and Lightning imported before the clock
            starts), as a user's run is: what a first fit imports or builds once is counted. ``False``: all
            fits in this process, so only the first pays it (the figures before stop 48).
        engines: the engines whose QAT variants run (``fx``: the defaults' engine; ``pt2e``).
    """
    fit = _fit_in_fresh_process if fresh_process else one_fit
    out: dict[str, Any] = {}
    for model in models:
        for n in epochs:
            variants = [v for v in FIT_VARIANTS if ("compile" not in v or n >= compile_from_epochs)
                        and (v == "float" or ("pt2e" if "PT2E" in v else "fx") in engines)]
            times: dict[str, list[float]] = {k: [] for k in variants}
            cpu_times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(repeats):
                for name in variants:
                    wall, cpu = fit(model, n, name)
                    times[name].append(wall)
                    cpu_times[name].append(cpu)
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            cpu_med = {k: sorted(v)[len(v) // 2] for k, v in cpu_times.items()}
            key = f"{model}, {n} epochs"
            out[key] = {"fit_s": {k: round(v, 2) for k, v in med.items()},
                        "over_float": {k: round(v / med["float"], 2) for k, v in med.items() if k != "float"},
                        # process CPU time: on a shared machine the wall clock also counts other tenants' load
                        "cpu_s": {k: round(v, 2) for k, v in cpu_med.items()},
                        "cpu_over_float": {k: round(v / cpu_med["float"], 2) for k, v in cpu_med.items() if k != "float"},
                        "all_s": {k: [round(t, 2) for t in v] for k, v in times.items()},
                        "process": "fresh" if fresh_process else "shared"}
            _log(f"fit {key}: wall {out[key]['fit_s']} -> {out[key]['over_float']}; "
                 f"CPU {out[key]['cpu_s']} -> {out[key]['cpu_over_float']}")
    return out


def fast_path_equivalence(spec: ModelSpec, steps: int = 3) -> dict[str, Any]:
    """Train the torch.ao-prepared model and the fast one side by side from the same state; compare."""
    from qlightning.engines.fx.fast_fq import swap_fake_quant

    torch.manual_seed(0)
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    base = set_phase(qlightning_prepare(spec.build(), x[:1], fast=False), QAT_ON)
    results = {}
    for label, conv_bn, relu in (("fake_quant (bit-exact)", False, False), ("fake_quant + relu fusion (bit-exact)", False, True),
                                 ("fake_quant + relu + conv_bn (float rounding)", True, True)):
        ref, fast = copy.deepcopy(base), copy.deepcopy(base)
        swap_fake_quant(fast, fake_quant=True, conv_bn=conv_bn, relu=relu)
        sr, sf = train_step(ref, x, y), train_step(fast, x, y)
        torch.manual_seed(1)
        for _ in range(steps):
            sr()
            sf()
        ref.eval(), fast.eval()
        with torch.no_grad():
            out_r, out_f = ref(x), fast(x)
        worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref.state_dict().values(), fast.state_dict().values()))
        results[label] = {
            "steps": steps,
            "outputs_equal": bool(torch.equal(out_r, out_f)),
            "state_equal": all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), fast.state_dict().values())),
            "max_abs_output_diff": float((out_r - out_f).abs().max()),
            "max_abs_state_diff": worst,
        }
    return results


# ---------------------------------------------------------------------------------------------- memory


_MEMORY_CHILD = r"""
import copy, gc, json, sys, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from benchmarks.models import model_spec
from benchmarks import suites

def rss_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

spec = model_spec(sys.argv[1], quick=sys.argv[2] == "1")
torch.manual_seed(0)
x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
out = {}
for variant in sys.argv[3].split(","):
    m = spec.build()
    if variant == "torch.ao FX":
        m = suites.set_phase(suites.torchao_fx_prepare(m, x[:1]), suites.QAT_ON)
    elif variant == "qlightning FX":
        m = suites.set_phase(suites.qlightning_prepare(m, x[:1]), suites.QAT_ON)
    step = suites.train_step(m, x, y)
    step(); step()
    gc.collect()
    before = rss_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    step()
    peak = rss_kb("VmHWM")
    saved = suites.saved_tensor_bytes(m, x, y)
    out[variant] = {"rss_growth_kb": peak - before, "saved_for_backward_bytes": saved}
    del m, step
    gc.collect()
print("RESULT " + json.dumps(out))
"""


def saved_tensor_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes of distinct storages autograd keeps for backward after one forward (activations, masks)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), y)
    del loss
    return sum(n for ptr, n in seen.items() if ptr not in params and ptr != x.untyped_storage().data_ptr())


def memory(name: str, quick: bool, variants: tuple[str, ...] = ("float", "torch.ao FX", "qlightning FX")) -> dict[str, Any]:
    """Peak RSS growth in one train step (fresh process; glibc told to mmap every block >= 64 KiB, so
    freed tensors leave RSS at once and the peak tracks live memory), and saved-for-backward bytes."""
    result, error = _child_result(_MEMORY_CHILD, name, "1" if quick else "0", ",".join(variants), timeout=900,
                                  MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    if result is None:
        return {"error": error[-2000:]}
    data = json.loads(result)
    base = data["float"]
    for v in data.values():
        v["rss_over_float"] = round(v["rss_growth_kb"] / base["rss_growth_kb"], 3) if base["rss_growth_kb"] > 0 else None
        v["saved_over_float"] = round(v["saved_for_backward_bytes"] / base["saved_for_backward_bytes"], 3)
    return data


# ---------------------------------------------------------------------------------------------- int8 latency


def calibrated_fake_quant(spec: ModelSpec, float_model: nn.Module, x: torch.Tensor, engine: str = "fx") -> nn.Module:
    """A prepared model whose observers saw a few batches, then frozen (fake-quant on, BN frozen), eval."""
    if engine == "fx":
        prepared = qlightning_prepare(copy.deepcopy(float_model), x[:1], "fx")
    else:
        prepared = qlightning_prepare(copy.deepcopy(float_model), x[:1], "pt2e")
    set_phase(prepared, QAT_ON, engine)
    prepared.train()
    with torch.no_grad():
        for i in range(3):
            prepared(x)
    set_phase(prepared, Phase(True, False, True), engine)
    return prepared.eval()


def warm_train(model: nn.Module, spec: ModelSpec, steps: int) -> nn.Module:
    """A few float Adam steps on a fixed random batch: the logits of a freshly initialized net are nearly
    flat, so int8 noise flips argmaxes at random and the parity check would measure nothing."""
    x, y = spec.inputs(64, seed=7), spec.labels(64, seed=7)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval()


def latency(spec: ModelSpec, batches: tuple[int, ...], repeats: int, clock: str, candidates: dict[int, tuple[str, ...]],
            pt2e_inductor_batches: tuple[int, ...], train_steps: int = 30) -> dict[str, Any]:
    """float eager vs every int8 runtime, per batch size; plus what ``lowering=auto`` picks."""
    from qlightning.quantize.lowering import choose_lowering

    torch.manual_seed(0)
    float_model = warm_train(spec.build(), spec, train_steps) if train_steps else spec.build().eval()
    calib = spec.inputs(max(max(batches), 32), seed=1)
    fx_fake = calibrated_fake_quant(spec, float_model, calib)
    with quiet():
        fx_int8 = get_engine("fx").convert(copy.deepcopy(fx_fake), QuantSpec(backend="x86"))
    pt2e_int8 = None
    if pt2e_inductor_batches:
        try:
            with quiet():
                pt2e_fake = calibrated_fake_quant(spec, float_model, calib, "pt2e")
                pt2e_int8 = get_engine("pt2e").convert(copy.deepcopy(pt2e_fake), QuantSpec(backend="x86"))
        except Exception as exc:
            _log(f"{spec.name}: PT2E convert failed: {type(exc).__name__}: {exc}")
    out: dict[str, Any] = {}
    for batch in batches:
        x = spec.inputs(batch, seed=2)
        extra: dict[str, nn.Module] = {"float": float_model}
        if pt2e_int8 is not None and batch in pt2e_inductor_batches:
            from qlightning.quantize.lowering import InductorModule

            start = time.perf_counter()
            try:
                module = InductorModule(copy.deepcopy(pt2e_int8))
                with quiet():
                    module(x)
                extra["pt2e+inductor (torchao)"] = module
            except Exception as exc:
                _log(f"{spec.name}: PT2E inductor compile failed: {type(exc).__name__}: {exc}")
            out.setdefault("build_s", {})[f"pt2e+inductor bs{batch}"] = round(time.perf_counter() - start, 2)
        floats: dict[str, Any] = {}

        def timer(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
            # float eager and the PT2E baseline timed with the lowering candidates: one run, one set of ratios;
            # in blocks, since the runtimes' thread pools spin after each call and would slow the next runtime's
            every = dict(fns)
            for name, module in extra.items():
                def run(m: nn.Module = module) -> None:
                    with torch.inference_mode():
                        m(x)
                every[name] = run
            stats = blocked_medians(every, repeats, warmup=3, clock=clock)
            floats.update(stats)
            return {k: v["median"] * 1e3 for k, v in stats.items() if k in fns}

        # parity over 32 samples in batches of the timed shape (a compiled candidate is shape-specialized),
        # drawn like the warm-up batch
        pool = spec.inputs(64, seed=7)[:32]
        parity = [pool[i:i + batch] for i in range(0, 32, batch)] if batch <= 32 else [spec.inputs(batch, seed=3)]
        with quiet():
            choice = choose_lowering(fx_fake, fx_int8, (x,), candidates=candidates.get(batch, ("fx",)), timer=timer,
                                     parity_inputs=parity)
        ms = {k: v["median"] * 1e3 for k, v in floats.items()}
        out[str(batch)] = {
            "latency_ms": {k: round(v, 4) for k, v in ms.items()},
            "float_over": {k: round(ms["float"] / v, 3) for k, v in ms.items() if k != "float"},
            "lowering": choice.to_dict(),
        }
        out[str(batch)]["float_over"]["lowering=auto"] = round(ms["float"] / ms[choice.name], 3)
    return out


# ---------------------------------------------------------------------------------------------- prepare / convert scaling


def prepare_convert_scaling(blocks: tuple[int, ...], engines: tuple[str, ...] = ("fx",), profile_top: int = 0) -> dict[str, Any]:
    """Wall time of prepare and convert for a chain of N conv-bn-relu blocks (warm process)."""
    out: dict[str, Any] = {}
    x = torch.randn(2, 1, 8, 8)
    for engine in engines:
        eng = get_engine(engine)
        spec = QuantSpec(backend="x86")
        with quiet():  # warm-up: first-call imports and caches are not what scales
            warm = eng.prepare(ConvBnReluChain(2), Inputs((x,)), spec)
            eng.convert(warm, spec)
        for n in blocks:
            model = ConvBnReluChain(n)
            gc.collect()
            start, cpu = time.perf_counter(), time.thread_time()
            with quiet():
                prepared = eng.prepare(model, Inputs((x,)), spec)
            t_prepare, c_prepare = time.perf_counter() - start, time.thread_time() - cpu
            with torch.no_grad():
                prepared(x)
            start, cpu = time.perf_counter(), time.thread_time()
            with quiet():
                eng.convert(prepared, spec)
            t_convert, c_convert = time.perf_counter() - start, time.thread_time() - cpu
            # CPU time of this (single, Python) thread: what the work costs, without time spent preempted
            out[f"{engine}:{n}"] = {"prepare_s": round(c_prepare, 3), "convert_s": round(c_convert, 3),
                                    "total_s": round(c_prepare + c_convert, 3),
                                    "wall_s": round(t_prepare + t_convert, 3)}
            _log(f"scaling {engine} {n} blocks: prepare {t_prepare:.2f}s convert {t_convert:.2f}s")
    return out


_COLD_CHILD = r"""
import time, warnings
warnings.filterwarnings("ignore")
t0 = time.perf_counter()
import torch
from qlightning import Inputs, QuantSpec, get_engine
from qlightning.examples.digits import DigitsCNN
t1 = time.perf_counter()
eng = get_engine("fx")
m = DigitsCNN()
t2 = time.perf_counter()
eng.prepare(m, Inputs((torch.zeros(1, 1, 8, 8),)), QuantSpec(backend="x86"))
t3 = time.perf_counter()
eng.prepare(DigitsCNN(), Inputs((torch.zeros(1, 1, 8, 8),)), QuantSpec(backend="x86"))
t4 = time.perf_counter()
print(f"RESULT {t1 - t0:.3f} {t3 - t2:.3f} {t4 - t3:.3f}")
"""


def cold_prepare() -> dict[str, Any]:
    """First prepare in a fresh process vs the second one (the import cost is reported apart)."""
    result, error = _child_result(_COLD_CHILD, timeout=300)
    if result is None:
        return {"error": error[-2000:]}
    imp, first, second = (float(v) for v in result.split())
    return {"import_s": imp, "first_prepare_s": first, "second_prepare_s": second}


# ---------------------------------------------------------------------------------------------- accuracy


def digits_accuracy(seeds: tuple[int, ...] = (0, 1, 2), epochs: int = 8) -> dict[str, Any]:
    """Digits CNN trained with the default schedule (float warm-up 3 epochs, observers and BN frozen at
    6, 8 epochs, Adam 1e-2 with cosine decay) through torch.ao's FX QAT and through the fast path;
    int8 test accuracy and the share of test predictions on which the two int8 models agree."""
    from qlightning.examples.digits import DigitsCNN, DigitsDataModule

    dm = DigitsDataModule(seed=0)
    dm.setup()
    x, y = dm.splits["train"].tensors
    tx, ty = dm.splits["test"].tensors
    out: dict[str, Any] = {}
    for seed in seeds:
        preds = {}
        for variant in ("torch.ao FX", "qlightning FX"):
            torch.manual_seed(seed)
            net = DigitsCNN()
            prepared = qlightning_prepare(net, x[:1], fast=variant == "qlightning FX")
            optimizer = torch.optim.Adam(prepared.parameters(), lr=1e-2)
            steps = epochs * -(-len(x) // 64)
            scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
            g = torch.Generator().manual_seed(seed)
            for epoch in range(epochs):
                set_phase(prepared, Phase(fake_quant=epoch >= 3, observe=epoch < 6, bn_frozen=epoch >= 6))
                prepared.train()
                order = torch.randperm(len(x), generator=g)
                for i in range(0, len(x), 64):
                    idx = order[i:i + 64]
                    optimizer.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(prepared(x[idx]), y[idx]).backward()
                    optimizer.step()
                    scheduler.step()
            with quiet():
                int8 = get_engine("fx").convert(prepared, QuantSpec(backend="x86"))
            with torch.no_grad():
                preds[variant] = int8(tx).argmax(1)
            out.setdefault(variant, []).append(round(float((preds[variant] == ty).float().mean()), 4))
        out.setdefault("agreement", []).append(round(float((preds["torch.ao FX"] == preds["qlightning FX"]).float().mean()), 4))
    return out
