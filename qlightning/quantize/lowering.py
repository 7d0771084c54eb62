"""``lowering=auto``: run the int8 model on whichever runtime is fastest here, if it is faithful.

Which int8 runtime is fastest depends on the model, the batch size and the CPU (measured on one
2-core AVX-512 box, float eager over int8, batch 1: FX eager 1.0-3.9x, onnxruntime QDQ 1.8-5.2x;
batch 32: FX eager 1.5-2.6x, inductor 2.2-3.2x; see ``notes/perf.md``). :func:`choose_lowering`
builds each candidate from the converted model, checks it against the fake-quant model on the
example input (output SQNR and top-1 agreement) and keeps the fastest that passes:

``fx``
    the engine's own converted module, run eagerly (FX: torch.ao ``convert_fx`` lowered to the
    fbgemm / x86 / onednn kernels; PT2E: torchao's q/dq reference graph).
``onnxruntime``
    the q/dq graph (:func:`reference_qdq_module` semantics: the int8 model's qparams and
    activation ranges, weights as int8 constants) exported to QDQ ONNX and run by onnxruntime's CPU
    provider, which fuses QDQ pairs into QLinearConv / MatMulInteger kernels.
``inductor``
    the same q/dq graph compiled by ``torch.compile`` (inductor) with ``freezing`` on: inductor's
    x86 quantization passes turn q/dq + conv / linear into oneDNN int8 kernels (the PT2E + inductor
    path torchao documents). Compiled for the example input's shapes; another shape recompiles.

Other runtimes plug in through ``builders={"name": callable(context) -> module}``.

The chosen module is an ``nn.Module`` that can replace the converted one in the LightningModule;
:func:`source_of` returns the engine's converted module behind a wrapper (for TorchScript exports,
which only the ``fx`` candidate supports).

Example::

    choice = choose_lowering(fake_quant_net, int8_net, (x,), candidates=("fx", "onnxruntime", "inductor"))
    model.net = choice.module
    print(choice.name, choice.latency_ms, choice.sqnr_db)
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from qlightning.core.inputs import Inputs, attach_source, first_tensor, source_of  # noqa: F401  source_of: re-exported
from qlightning.core.metrics import median_ms, sqnr_db, top1_agreement
from qlightning.core.quiet import quiet
from qlightning.engines import ENGINES, QuantEngine, get_engine
from qlightning.errors import EngineUnavailableError, QLightningError
from qlightning.quantize.qdq import (clamps_before_quantize, explicit_activation_clamps, float_round_trips,
                                    quiet_export, qdq_program, uint8_loads_are_slow, write_onnx)

#: the lowering that keeps the engine's own int8 module, whichever the engine (named after FX, the first one)
ENGINE_MODULE = "fx"
CANDIDATES = (ENGINE_MODULE, "onnxruntime", "inductor")
DEFAULT_MIN_SQNR_DB = 25.0
DEFAULT_MIN_TOP1 = 0.99


class LoweringError(RuntimeError):
    """A candidate runtime could not be built or run."""


# ---------------------------------------------------------------------------------------------- runtimes


class OnnxRuntimeModule(nn.Module):
    """An onnxruntime CPU session as an ``nn.Module``: tensors in, tensors out.

    The serialized model is a ``uint8`` buffer (so ``state_dict``, ``deepcopy`` and pickling carry
    it); the session is created on first use with ``threads`` intra-op threads (default: torch's).

    Args:
        model_bytes: the serialized ONNX model.
        input_names: the ONNX graph's input names, in the order of the positional inputs.
        threads: onnxruntime intra-op threads; ``None`` uses ``torch.get_num_threads()``.
    """

    def __init__(self, model_bytes: bytes, input_names: Sequence[str], threads: Optional[int] = None) -> None:
        super().__init__()
        self.register_buffer("onnx_model", torch.frombuffer(bytearray(model_bytes), dtype=torch.uint8).clone())
        self.input_names = list(input_names)
        self.threads = threads
        self._session: Any = None

    def _get_session(self) -> Any:
        if self._session is None:
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = int(self.threads or torch.get_num_threads())
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self._session = ort.InferenceSession(self.onnx_model.numpy().tobytes(), options, providers=["CPUExecutionProvider"])
        return self._session

    def forward(self, *args: torch.Tensor) -> Any:
        """Run the ONNX model on onnxruntime's CPU provider.

        Args:
            args: the positional inputs, in the exported order.
        """
        session = self._get_session()
        feed = {n: a.detach().cpu().contiguous().numpy() for n, a in zip(self.input_names, args)}
        outs = [torch.from_numpy(o) for o in session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_session"] = None
        state.pop("_qlightning_source", None)  # the engine's module stays with the process that made it
        return state


def _outside_inference_mode(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a normal copy of it if it was made under ``torch.inference_mode``."""
    if not tensor.is_inference():
        return tensor
    with torch.inference_mode(False):
        return tensor.clone()


class InductorModule(nn.Module):
    """A q/dq graph compiled by inductor with ``freezing`` (int8 conv / linear via oneDNN).

    The code that calls the kernels is C++ (inductor's ``cpp_wrapper``) where it compiles: the Python
    wrapper spent about 1 ms of a 5 ms call of a small int8 conv net at batch 32 calling 50-100 kernels and
    checking each one's sizes (torch 2.14.1, 2 cores: shufflenet_v2 FX 5.8 -> 4.9 ms, mobilenet_v2 FX
    5.2 -> 4.5 ms, the same outputs; ``notes/perf.md`` section 18). A graph whose C++ wrapper does not
    compile runs with the Python one (``wrapper`` says which). The graph's parameters and buffers are not
    guarded: ``freezing`` compiles them in as constants, so the module is a deployment artifact whose weights
    do not change (a new input shape, dtype or grad mode still compiles again).

    Args:
        graph: the q/dq module to compile (an exported program's module, exported in eval mode).
        dynamic: passed to ``torch.compile(dynamic=...)``; compiling happens on the first call, and again for
            each new input shape. (Not ``None``: with ``freezing`` on, the dynamic-shape recompile of a
            quantized conv net fails a stride assertion in inductor's generated code, torch 2.13.)
        cpp_wrapper: try inductor's C++ wrapper first (``False``: the Python wrapper only).
    """

    def __init__(self, graph: nn.Module, dynamic: bool = False, cpp_wrapper: bool = True) -> None:
        super().__init__()
        self.graph = graph  # an exported program's module: eval() raises, and it was exported in eval mode
        self.dynamic = dynamic
        self.wrapper = "cpp" if cpp_wrapper else "python"
        self._compiled: Any = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module compiled by inductor (compiled on the first call).

        Args:
            args: positional inputs.
            kwargs: keyword inputs.
        """
        from torch._dynamo.exc import BackendCompilerFailed

        if self._compiled is None:
            from qlightning.engines.pt2e.inductor import x86_int8_passes

            # torch >= 2.14: torchao's passes, registered on import (an FX-only process had none); here, not at
            # build, so that a copy pickled into another process has them too; choose_lowering's first call refuses
            missing = x86_int8_passes()
            if missing:
                raise LoweringError(f"inductor: {missing}")
            # no guards on the graph's parameters and buffers: freezing makes them constants of the compiled code
            # anyway, and checking them took 0.2 ms of shufflenet_v2's 3.9 ms call (the inputs stay guarded)
            self._compiled = torch.compile(self.graph, dynamic=self.dynamic, options={
                "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        # dynamo guards on each input's dispatch keys, which inference_mode changes (its tensors lack the
        # autograd keys, and the mode hides them on the others): Lightning validates and tests under it, and
        # every mix of the two compiled the graph again (six compiles of MiniLM's encoder in one run)
        args, kwargs = tree_map_only(torch.Tensor, _outside_inference_mode, (args, kwargs))
        try:
            return self._run(args, kwargs)
        except BackendCompilerFailed:
            if self.wrapper != "cpp":
                raise
            # a failed compile leaves no cache entry, so the next call compiles again, here with the Python wrapper
            self.wrapper = "python"
            return self._run(args, kwargs)

    def _run(self, args: Any, kwargs: Any) -> Any:
        import torch._inductor.config as inductor_config

        with torch.inference_mode(False), torch.no_grad(), inductor_config.patch(
            freezing=True, cpp_wrapper=self.wrapper == "cpp"
        ):
            return self._compiled(*args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_compiled"] = None
        state.pop("_qlightning_source", None)
        return state


# ---------------------------------------------------------------------------------------------- building


@dataclass
class LoweringContext:
    """What a candidate builder gets: the two models, the inputs, and the q/dq graph (built once, lazily)."""

    fake_quant: nn.Module
    int8: nn.Module
    inputs: Inputs
    threads: Optional[int] = None
    qdq_module: Optional[nn.Module] = None
    _qdq_program: Any = None

    def qdq_program(self) -> Any:
        """:class:`qlightning.run.export.QdqProgram` of the q/dq graph (weights folded to int8 constants)."""
        if self._qdq_program is None:
            if self.qdq_module is None:
                self.qdq_module = reference_qdq_module(self.fake_quant, self.int8)
            self._qdq_program = qdq_program(self.qdq_module, self.inputs, dynamic_batch=True)
        return self._qdq_program


def engine_of(int8: nn.Module) -> QuantEngine:
    """The engine whose ``convert`` made ``int8`` (FX's quantized kernels, PT2E's q/dq graph).

    Args:
        int8: a converted module (or a lowering wrapper around one).
    """
    available = []
    for name in ENGINES:
        try:
            available.append(get_engine(name))
        except EngineUnavailableError:
            continue
        if available[-1].converted_here(int8):
            return available[-1]
    # a graph without quantized ops (everything left float) is its own q/dq graph
    for engine in available:
        if engine.converts_to_qdq_graph:
            return engine
    raise QLightningError(f"{type(int8).__name__}: not an int8 module any engine ({list(ENGINES)}) converted")


def reference_qdq_module(fake_quant: nn.Module, int8: nn.Module) -> nn.Module:
    """A float q/dq graph that computes what ``int8`` computes (the engine's ``reference_module``).

    Args:
        fake_quant: the prepared (fake-quant) module ``int8`` was converted from.
        int8: the engine's converted module: FX's lowered kernels, or PT2E's q/dq graph (already one).
    """
    return engine_of(int8).reference_module(fake_quant, int8, None)


def _build_fx(ctx: LoweringContext) -> nn.Module:
    return ctx.int8


def _build_onnxruntime(ctx: LoweringContext) -> nn.Module:
    program = ctx.qdq_program()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        write_onnx(program, path)
        data = path.read_bytes()
    return attach_source(OnnxRuntimeModule(data, program.input_names, ctx.threads), ctx.int8)


def _build_inductor(ctx: LoweringContext) -> nn.Module:
    if not engine_of(ctx.int8).converts_to_qdq_graph:
        with quiet_export():
            graph = ctx.qdq_program().program.module()  # a new module: the rewrite below is inductor's own
        clamps_before_quantize(graph)
    else:
        graph = copy.deepcopy(ctx.int8)
        if isinstance(graph, torch.fx.GraphModule):
            # inductor fuses dq -> conv -> q into one oneDNN conv with a uint8 output over 0..255, whatever the
            # quantize's range: a reduce_range (0..127) quantize, the PT2E default on CPUs without VNNI, gave codes
            # up to 255, which then saturated the next conv's int16 pair sums (resnet50 PT2E on an AVX2 CPU:
            # inductor 9.9 dB from its q/dq graph). An explicit clamp before each narrow quantize keeps the trained
            # range (the FX route's own treatment); its max pools then run on the codes (inductor's kernel).
            explicit_activation_clamps(graph)
            clamps_before_quantize(graph)
    if uint8_loads_are_slow():
        float_round_trips(graph)  # float ops read float32, not codes they would load 8 at a time through a buffer
    return attach_source(InductorModule(graph), ctx.int8)  # compiles on its first call (choose_lowering times it)


BUILDERS: dict[str, Callable[[LoweringContext], nn.Module]] = {
    ENGINE_MODULE: _build_fx,
    "onnxruntime": _build_onnxruntime,
    "inductor": _build_inductor,
}


# ---------------------------------------------------------------------------------------------- choosing


@dataclass
class LoweringChoice:
    """The chosen runtime and every candidate's measurements.

    Attributes:
        name: the chosen candidate.
        module: the module to put in place of the converted one.
        latency_ms: median latency per candidate on the example input (``None``: not measured).
        sqnr_db: output SQNR of each candidate against the fake-quant model, in dB.
        top1_agreement: share of rows whose argmax agrees with the fake-quant model (``None``: no class dim).
        top1_rows: how many rows each ``top1_agreement`` was measured on (its sampling noise).
        errors: why a candidate was not eligible (build failure, parity breach).
        build_s: seconds spent building (exporting) each candidate, its first call excluded.
        first_call_s: seconds of each candidate's first call on the example input: for ``inductor``
            the ``torch.compile`` compilation (steady-state latency is ``latency_ms``).
        parity_on: what ``sqnr_db`` and ``top1_agreement`` were measured on, in words.
        compiled_with: how each compiled candidate runs its kernels: for ``inductor``, ``"cpp wrapper"`` or
            ``"python wrapper"`` (the C++ one did not compile).
    """

    name: str
    module: nn.Module
    latency_ms: dict[str, Optional[float]] = field(default_factory=dict)
    sqnr_db: dict[str, Optional[float]] = field(default_factory=dict)
    top1_agreement: dict[str, Optional[float]] = field(default_factory=dict)
    top1_rows: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    build_s: dict[str, float] = field(default_factory=dict)
    first_call_s: dict[str, float] = field(default_factory=dict)
    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB
    min_top1: float = DEFAULT_MIN_TOP1
    batch_size: Optional[int] = None
    threads: int = 1
    repeats: int = 0
    parity_on: str = "the example input"
    compiled_with: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> list[str]:
        """The candidates in ``latency_ms`` that have no entry in ``errors``."""
        return [n for n in self.latency_ms if n not in self.errors]

    def speedup_over(self, other: str) -> Optional[float]:
        """How many times faster the kept runtime is than ``other`` (``None`` when either was not timed).

        Args:
            other: a candidate's name.
        """
        a, b = self.latency_ms.get(self.name), self.latency_ms.get(other)
        return None if not a or not b else b / a

    def to_dict(self) -> dict[str, Any]:
        """Plain data (without the module) for report.json and the checkpoint."""
        data = {k: copy.deepcopy(v) for k, v in self.__dict__.items() if k != "module"}
        data["passed"] = self.passed
        return data


def choose_lowering(
    fake_quant_module: nn.Module,
    int8_module: nn.Module,
    example_inputs: Any,
    candidates: Sequence[str] = CANDIDATES,
    *,
    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB,
    min_top1: float = DEFAULT_MIN_TOP1,
    repeats: int = 20,
    warmup: int = 3,
    threads: Optional[int] = None,
    fallback: str = ENGINE_MODULE,
    tolerance_db: Optional[float] = 1.0,
    builders: Optional[Mapping[str, Callable[[LoweringContext], nn.Module]]] = None,
    qdq_module: Optional[nn.Module] = None,
    parity_inputs: Optional[Sequence[Any]] = None,
    timer: Optional[Callable[[Mapping[str, Callable[[], Any]]], Mapping[str, float]]] = None,
) -> LoweringChoice:
    """Build, check and time every candidate; keep the fastest one that is faithful to the fake-quant model.

    Args:
        fake_quant_module: the trained fake-quant module (the parity reference; run on a copy, so its
            observers never move).
        int8_module: the engine's converted module (candidate ``fx``).
        example_inputs: a tensor, a tuple of positional inputs or an :class:`Inputs`; the latency and the
            parity are measured on it, so use a representative batch.
        candidates: names from :data:`BUILDERS` (``fx``, ``onnxruntime``, ``inductor``) or ``builders``.
        min_sqnr_db / min_top1: parity thresholds against the fake-quant output; a candidate below
            either is not eligible, unless it is as faithful as ``fallback`` (see ``tolerance_db``).
        tolerance_db: a candidate that misses the thresholds still passes when its SQNR is within this
            many dB of the ``fallback`` candidate's and its top-1 agreement within 1 point of it: it is
            then as faithful as the module the engine gives anyway (whose own gap to the fake-quant model
            is the parity gate's business, :mod:`qlightning.run.parity`). ``None``: thresholds only.
        repeats / warmup: timing; medians of calls in blocks, the candidates' blocks taken in turn (:func:`median_ms`).
        threads: torch (and onnxruntime) intra-op threads while building and timing (``None``: unchanged).
        fallback: the candidate kept when none is eligible (normally ``fx``, what the engine gave).
        builders: extra or replacement candidate builders, ``name -> callable(LoweringContext) -> module``.
        qdq_module: a ready q/dq reference module (else built from the two models).
        parity_inputs: batches (each a tensor or a tuple of positional inputs) on which the parity is
            measured, all outputs concatenated; default: the example input alone. Use several batches
            of the example's shape (a compiled candidate would recompile for another shape), e.g. 32
            single-sample batches when timing batch 1, so that top-1 agreement is over 32 rows.
        timer: replaces the wall-clock timer (``{name: fn} -> {name: ms}``); for tests.

    Returns:
        A :class:`LoweringChoice` (``name``, ``module`` and per-candidate ``latency_ms``, ``sqnr_db``,
        ``top1_agreement``, ``errors``, ``build_s``).
    """
    inputs = example_inputs if isinstance(example_inputs, Inputs) else Inputs(
        (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    )
    table = {**BUILDERS, **dict(builders or {})}
    unknown = [c for c in candidates if c not in table]
    if unknown:
        raise ValueError(f"choose_lowering: unknown candidate(s) {unknown}; valid: {sorted(table)}")
    if fallback not in candidates:
        candidates = [fallback, *candidates]
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        # keyword inputs (e.g. input_ids=, attention_mask=) reach candidates that take them (fx, inductor);
        # the exported ones (onnxruntime) take positional inputs and fail to build, which disqualifies them
        batches = [(inputs.args, inputs.kwargs)] if not parity_inputs else [
            ((b,), {}) if isinstance(b, torch.Tensor) else
            ((tuple(b.args), dict(b.kwargs)) if isinstance(b, Inputs) else (tuple(b), {})) for b in parity_inputs
        ]

        def outputs(module: nn.Module) -> torch.Tensor:
            with torch.no_grad():
                outs = [first_tensor(module(*args, **kwargs)).float() for args, kwargs in batches]
            return outs[0] if len(outs) == 1 else torch.cat([o.reshape(1) if o.dim() == 0 else o for o in outs])

        reference_module = copy.deepcopy(fake_quant_module).eval()
        with quiet(all_warnings=True):
            reference = outputs(reference_module)
        ctx = LoweringContext(fake_quant_module, int8_module, inputs, threads=threads, qdq_module=qdq_module)
        built: dict[str, nn.Module] = {}
        choice = LoweringChoice(name=fallback, module=int8_module, min_sqnr_db=min_sqnr_db, min_top1=min_top1,
                                batch_size=_batch_size(inputs), threads=torch.get_num_threads(), repeats=repeats)
        if parity_inputs:
            choice.parity_on = f"{len(batches)} given batches"
        for name in dict.fromkeys(candidates):
            start = time.perf_counter()
            first = None
            try:
                with quiet(all_warnings=True):
                    module = table[name](ctx)
                    choice.build_s[name] = round(time.perf_counter() - start, 3)
                    first = time.perf_counter()
                    with torch.no_grad():
                        module(*inputs.args, **inputs.kwargs)  # the first call: compilation for compiled runtimes
                    choice.first_call_s[name] = round(time.perf_counter() - first, 3)
                    if isinstance(module, InductorModule):
                        choice.compiled_with[name] = f"{module.wrapper} wrapper"
                    output = outputs(module)
            except Exception as exc:  # a runtime that cannot take this model is simply not a candidate
                choice.errors[name] = f"build/run failed: {type(exc).__name__}: {str(exc)[:500]}"
                if first is None:
                    choice.build_s[name] = round(time.perf_counter() - start, 3)
                else:
                    choice.first_call_s.setdefault(name, round(time.perf_counter() - first, 3))
                continue
            choice.sqnr_db[name] = round(sqnr_db(reference, output), 2)
            top1 = top1_agreement(reference, output)
            choice.top1_agreement[name] = None if top1 is None else round(top1, 4)
            choice.top1_rows[name] = int(output[..., 0].numel()) if output.dim() >= 2 else 0
            built[name] = module
        for name in built:
            problems = _parity_problems(choice, name, fallback, tolerance_db)
            if problems:
                choice.errors[name] = "parity: " + "; ".join(problems)

        def runner(m: nn.Module) -> Callable[[], Any]:
            def run() -> None:
                with torch.inference_mode():
                    m(*inputs.args, **inputs.kwargs)

            return run

        fns = {name: runner(m) for name, m in built.items()}
        latency = timer(fns) if timer is not None else median_ms(fns, repeats, warmup)
        choice.latency_ms = {name: (round(latency[name], 4) if name in latency else None) for name in candidates}
        eligible = [n for n in built if n not in choice.errors and latency.get(n) is not None]
        if eligible:
            choice.name = min(eligible, key=lambda n: latency[n])
        elif fallback in built:
            choice.name = fallback
        choice.module = built.get(choice.name, int8_module)
        return choice
    finally:
        torch.set_num_threads(old_threads)


def _parity_problems(choice: LoweringChoice, name: str, fallback: str, tolerance_db: Optional[float]) -> list[str]:
    """Why ``name`` is not faithful enough: each metric that misses its threshold and is not within tolerance of
    the ``fallback`` candidate's (SQNR within ``tolerance_db``, top-1 agreement within sampling noise). A metric
    that meets its threshold is not compared with the fallback's: 42.5 dB is no reason to refuse a runtime whose
    agreement matches the fallback's (efficientnet_b0 PT2E, stop 54: inductor refused at 42.5 dB and 0.984 against
    the eager q/dq graph's 44.6 dB and 0.984, and ``auto`` shipped the q/dq graph at 0.67x float)."""
    sqnr, top1 = choice.sqnr_db[name], choice.top1_agreement[name]
    compared = tolerance_db is not None and fallback in choice.sqnr_db
    base_sqnr, base_top1 = (choice.sqnr_db[fallback], choice.top1_agreement[fallback]) if compared else (None, None)
    problems = []
    if sqnr < choice.min_sqnr_db and not (compared and sqnr >= base_sqnr - tolerance_db):
        problems.append(f"SQNR {sqnr:.1f} dB < {choice.min_sqnr_db} dB")
    if top1 is not None and top1 < choice.min_top1 and not (compared and (
            base_top1 is None or top1 >= base_top1 - _top1_noise(base_top1, choice.top1_rows.get(name, 0)))):
        problems.append(f"top-1 agreement {top1:.3f} < {choice.min_top1}")
    return problems


def _top1_noise(agreement: float, rows: int) -> float:
    """How far a top-1 agreement measured on ``rows`` rows moves by chance: two binomial standard errors
    (at least one point). Two runtimes that round differently (inductor's int8 kernels vs the eager q/dq
    graph) flip different near-tie rows, so at 0.78 agreement on 120 rows they differ by a few points."""
    if rows <= 0:
        return 0.01
    return max(0.01, 2.0 * math.sqrt(max(agreement * (1.0 - agreement), 0.0) / rows))


def _batch_size(inputs: Inputs) -> Optional[int]:
    for a in (*inputs.args, *inputs.kwargs.values()):
        if isinstance(a, torch.Tensor) and a.dim() > 0:
            return int(a.shape[0])
    return None
