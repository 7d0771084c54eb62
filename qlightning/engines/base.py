"""The one interface every quantization engine implements.

The callback speaks only this interface: prepare a float submodule, set the phase of the
schedule, switch observers off for evaluation, convert to a lowered int8 module. Everything that
knows torch.ao or torchao internals lives behind it, in one module per engine.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn

from qlightning.core.inputs import Inputs
from qlightning.core.schedule import Phase

BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")


@functools.lru_cache(maxsize=None)  # the CPU does not change under a process; the fallback reads a file
def x86_u8s8_pair_sums() -> Optional[str]:
    """What this CPU's x86 int8 kernels (oneDNN, fbgemm) add pairs of u8 x s8 products in: ``"int32"`` with VNNI
    (``vpdpbusd``: AVX512-VNNI, AVX-VNNI) or AMX, ``"int16"`` without (AVX2's ``vpmaddubsw``), ``None`` when this is
    not an x86 CPU or its flags cannot be read.

    ``"int16"`` saturates beyond 32767: 8-bit activations (0..255) times 8-bit weights (up to 127) reach 64770, so the
    int8 model stops computing what fake-quant trained (PT2E digits CNN through inductor: 14.8 dB from its q/dq
    reference on an AMD EPYC with AVX2; 68.5 dB with 7-bit activations).
    """
    vnni = ("avx512_vnni", "avx_vnni", "amx_int8")
    if hasattr(torch.cpu, "get_capabilities"):  # torch 2.13 has it; older releases may not
        caps = torch.cpu.get_capabilities()
        if caps.get("architecture") not in ("x86_64", "x86"):
            return None
        return "int32" if any(caps.get(flag, False) for flag in vnni) else "int16"
    try:  # older torch: the kernel's own flags (Linux)
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return None
    if any(flag in flags for flag in vnni):
        return "int32"
    return "int16" if "avx2" in flags else None


@dataclass
class QuantSpec:
    """Engine-neutral description of how to quantize one submodule.

    Attributes:
        backend: the int8 kernel library the model is lowered for; one of :data:`BACKENDS`.
        qconfig_mapping: ``None`` for the backend's default QAT mapping, else a native object of
            the engine (``QConfigMapping`` for FX) or plain data that :meth:`QuantEngine.resolve_spec`
            turns into one.
        prepare_custom_config: native prepare-time custom config (FX ``PrepareCustomConfig``) or ``None``.
        convert_custom_config: native convert-time custom config (FX ``ConvertCustomConfig``) or ``None``.
        backend_config: native backend config, ``None`` for the backend's own.
        is_qat: prepare for training (fake-quant) rather than for calibration (observers).
        options: engine-specific extras that the config layer passes through untouched.
    """

    backend: str = "x86"
    qconfig_mapping: Any = None
    prepare_custom_config: Any = None
    convert_custom_config: Any = None
    backend_config: Any = None
    is_qat: bool = True
    options: dict[str, Any] = field(default_factory=dict)


class QuantEngine(ABC):
    """prepare / set_phase / set_observers / convert: the symmetric pairs of a quantization engine."""

    name: ClassVar[str]
    #: whether :meth:`compile_training` has a compiled path to offer
    compiles_training: ClassVar[bool] = False
    #: whether :meth:`convert` returns a float q/dq graph (PT2E) rather than quantized kernels (FX): a
    #: q/dq graph is its own reference for exports and lowering, kernels need the prepared module kept
    converts_to_qdq_graph: ClassVar[bool] = False
    #: the PTQ modes it calibrates and converts (``PostTrainingQuantization(mode=...)``)
    ptq_modes: ClassVar[tuple[str, ...]] = ("static",)
    #: whether PTQ can apply input-weight equalization (``equalization=``) with it
    equalizes_inputs_and_weights: ClassVar[bool] = False
    #: whether a prepared module keeps the float submodules' names (so ModelPruning can follow them)
    keeps_module_names: ClassVar[bool] = False
    #: whether rank 0 of a spawn/fork strategy can hand its result back to the main process (its int8
    #: modules pickle and its prepared modules can be prepared again there)
    spawn_hand_over: ClassVar[bool] = False
    #: whether a pickled (or deep-copied) QAT callback leaves its kept fake-quant copies out, because
    #: this engine's prepared modules do not pickle
    pickles_without_prepared: ClassVar[bool] = False
    #: whether ``qlightning recipes validate`` / ``doctor`` dry-run prepare -> convert by default (seconds)
    dry_run_by_default: ClassVar[bool] = False

    def notes(self, spec: QuantSpec) -> list[tuple[bool, str]]:
        """What this engine chose for ``spec`` that a user should read before training, as ``(warning, text)``
        pairs: the callback logs them at prepare and a warning becomes one of the run's notices.

        Args:
            spec: the resolved spec.
        """
        return []

    def converted_here(self, module: nn.Module) -> bool:
        """Whether ``module`` is what this engine's :meth:`convert` makes (lowering asks, to pick the engine).

        Args:
            module: a converted module (the engine's, or another engine's).
        """
        return False

    @abstractmethod
    def prepare(self, module: nn.Module, inputs: Inputs, spec: QuantSpec) -> nn.Module:
        """Fuse and instrument a float module (train mode for QAT); return the module to put in its place.

        Args:
            module: the float submodule.
            inputs: its example inputs (tracing, export).
            spec: how to quantize it.
        """

    @abstractmethod
    def set_phase(self, module: nn.Module, phase: Phase) -> None:
        """Switch fake-quant, observers and BatchNorm statistics of a prepared module to ``phase``.

        Args:
            module: a module this engine prepared.
            phase: the schedule's phase.
        """

    @abstractmethod
    def set_observers(self, module: nn.Module, enabled: bool) -> None:
        """Enable or disable observer updates only (used around validation, test and predict).

        Args:
            module: a module this engine prepared.
            enabled: whether observers update.
        """

    @abstractmethod
    def convert(self, module: nn.Module, spec: QuantSpec) -> nn.Module:
        """Turn a prepared module into the quantized module lowered for ``spec.backend``.

        Args:
            module: a module this engine prepared.
            spec: the spec it was prepared with.
        """

    @abstractmethod
    def quant_state(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every buffer that belongs to an observer or fake-quant (statistics, scales, zero points, flags).

        Args:
            module: a module this engine prepared.
        """

    def resolve_spec(self, spec: QuantSpec, errors: list[str]) -> QuantSpec:
        """Turn plain-data parts of ``spec`` (dicts from a config) into the engine's native objects.

        Problems are appended to ``errors``; the default accepts native objects only.

        Args:
            spec: a spec whose parts may be plain data.
            errors: where problems are appended.
        """
        return spec

    def compile_training(self, module: nn.Module, **compile_kwargs: Any) -> bool:
        """Run the training forwards of a prepared module through ``torch.compile``, with the same state and
        the same int8 model; False where this engine has no compiled path. Undone by :meth:`decompile`.

        Args:
            module: a module this engine prepared.
            compile_kwargs: keyword arguments of ``torch.compile`` (``backend=...``).
        """
        return False

    def decompile(self, module: nn.Module) -> None:
        """Undo :meth:`compile_training`: eager forwards again (before converting, copying or pickling).

        Args:
            module: a module :meth:`compile_training` compiled (anything else is left alone).
        """

    def check_spec_against_model(self, spec: QuantSpec, modules: dict[str, nn.Module]) -> list[str]:
        """Config entries that name nothing in the modules about to be prepared.

        Args:
            spec: the resolved spec (its plain data in ``spec.options``).
            modules: ``{name: float submodule}`` about to be prepared.
        """
        return []

    def is_prepared(self, module: nn.Module) -> bool:
        """Whether ``module`` holds any observer or fake-quant state of this engine.

        Args:
            module: any module.
        """
        return any(True for _ in self.quant_state(module))

    def describe_qparams(self, module: nn.Module) -> dict[str, dict[str, Any]]:
        """Scale / zero point summaries per observer, for logging and reports.

        Args:
            module: a module this engine prepared.
        """
        return {}

    def reset_observers(self, module: nn.Module) -> int:
        """Forget every observer's running statistics (before a calibration on data); returns how many.

        Moving-average observers that ran while the weights were still changing hold an average of
        old ranges (with ``averaging_constant=0.01`` a short calibration barely moves it).

        Args:
            module: a module this engine prepared.
        """
        count = 0
        for m in module.modules():
            reset = getattr(m, "reset_min_max_vals", None)
            if callable(reset):
                reset()
                count += 1
        return count

    def takes_quantized_inputs(self, spec: QuantSpec) -> bool:
        """Whether modules converted with ``spec`` take int8 tensors (not float) as inputs.

        Args:
            spec: the resolved spec.
        """
        return False

    def export_limits(self, spec: QuantSpec) -> dict[str, str]:
        """What a module converted with ``spec`` cannot have, each with the reason (empty: everything).

        Keys: ``"reference"`` (no q/dq reference graph computes what the int8 module computes, so
        neither ONNX nor ``.pt2`` can be built and the parity gate has no int8 reference), ``"onnx"``,
        ``"pt2"``. Known before anything is prepared, so a run can refuse such a format before training.

        Args:
            spec: the resolved spec.
        """
        return {}

    def reference_module(self, prepared: nn.Module, int8: nn.Module, spec: Optional[QuantSpec]) -> nn.Module:
        """A float graph of quantize/dequantize ops that computes what ``int8`` computes.

        The exporters (ONNX, ``.pt2``) and the lowering candidates start from it. The default is a
        copy of the converted module, right for engines whose int8 model already is such a graph.

        Args:
            prepared: the prepared (fake-quant) module ``int8`` was converted from; never modified.
            int8: the engine's converted module.
            spec: the spec it was converted with (``None``: the engine's defaults).
        """
        return copy.deepcopy(int8).eval()


def quantized_engine(backend: str) -> "torch.backends.quantized._QEngineProp":
    """Select ``backend`` as torch's quantized kernel library (process-wide), checking it exists.

    Args:
        backend: one of :data:`BACKENDS`.
    """
    supported = torch.backends.quantized.supported_engines
    if backend not in supported:
        raise RuntimeError(f"quantized backend {backend!r} is not available in this torch build; available: {supported}")
    torch.backends.quantized.engine = backend
    return torch.backends.quantized.engine


def _per_channel_inputs(module: nn.Module) -> Iterator[tuple[nn.Module, tuple[int, ...]]]:
    """(fake-quant, shape of what it quantizes) pairs: QAT modules' ``weight_fake_quant`` (FX) and
    fake-quant nodes of a graph whose input shape is known (PT2E: ``meta["val"]`` of the exported graph;
    conv-bn QAT quantizes ``weight * bn_scale``, not a parameter)."""
    for m in module.modules():
        fq, weight = getattr(m, "weight_fake_quant", None), getattr(m, "weight", None)
        if isinstance(fq, nn.Module) and isinstance(weight, torch.Tensor):
            yield fq, tuple(weight.shape)
        if not isinstance(m, torch.fx.GraphModule):
            continue
        for node in m.graph.nodes:
            if node.op != "call_module" or not node.args or not isinstance(node.args[0], torch.fx.Node):
                continue
            val = node.args[0].meta.get("val", node.args[0].meta.get("tensor_meta"))
            shape = getattr(val, "shape", None)
            if shape is not None and all(isinstance(d, int) for d in shape):
                yield m.get_submodule(str(node.target)), tuple(shape)


def per_channel_counts(module: nn.Module) -> dict[int, int]:
    """``{id(fake-quant): channels}`` for the per-channel fake-quants of ``module`` whose input shape is known
    (:func:`_per_channel_inputs`): the size of the input along the fake-quant's ``ch_axis``.

    Args:
        module: a prepared module.
    """
    counts: dict[int, int] = {}
    for fq, shape in _per_channel_inputs(module):
        axis = getattr(fq, "ch_axis", 0)
        if getattr(fq, "is_per_channel", False) and len(shape) > axis:
            counts[id(fq)] = int(shape[axis])
    return counts


def zero_gammas(gammas: Iterable[tuple[str, Any]]) -> list[str]:
    """``"name (k of n channels)"`` for each BatchNorm weight (gamma) of ``gammas`` that is exactly 0 in some channel.

    Args:
        gammas: ``(BatchNorm name, its weight)`` pairs (a weight that is not a tensor, ``affine=False``, is skipped).
    """
    found = []
    for name, gamma in gammas:
        if isinstance(gamma, torch.Tensor):
            count = int((gamma.detach() == 0).sum())
            if count:
                found.append(f"{name} ({count} of {gamma.numel()} channels)")
    return found


def refuse_zero_gammas(found: Sequence[str], why: str, route: str) -> None:
    """Raise :class:`~qlightning.errors.ConfigError` naming the BatchNorms of ``found`` (:func:`zero_gammas`), if any.

    Args:
        found: the BatchNorms with a gamma of exactly 0.
        why: which fold divides by gamma.
        route: the engine's own way round, said before the model-side ones.
    """
    from qlightning.errors import ConfigError

    if found:
        shown = ", ".join(found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
        raise ConfigError(
            f"BatchNorm weight (gamma) is exactly 0 in {shown}: {why} divides the layer's output by gamma / std, "
            f"so training would be NaN from the first step. {route}, build the model without zero-init (timm: "
            "create_model(..., zero_init_last=False); torchvision ResNet: zero_init_residual=False), or load weights "
            "trained in float first."
        )


# The stock ``enable_observer`` / ``enable_fake_quant`` of torch.ao's and torchao's FakeQuantizeBase, which only
# write their flag buffer (registered by the engines that import them; a subclass's override is not in here).
_PLAIN_FLAG_SETTERS: set[Any] = set()


def register_plain_flag_setters(*functions: Any) -> None:
    """Declare ``functions`` (unbound ``enable_*`` methods) to do nothing but ``flag[0] = 1 if enabled else 0``.

    Args:
        functions: the methods, as found on the class.
    """
    _PLAIN_FLAG_SETTERS.update(functions)


def keeps_last_observation(fake_quant: nn.Module) -> bool:
    """Whether ``fake_quant``'s observer state is only its last observation: a moving average with
    ``averaging_constant=1`` (``min + 1 * (x_min - min)``), which the next observation overwrites, up to that
    sum's rounding. Learnable fake-quants (LSQ) are not counted: their scale is trained once observers stop.

    Args:
        fake_quant: a fake-quant module.
    """
    observer = getattr(fake_quant, "activation_post_process", None)
    return getattr(observer, "averaging_constant", None) == 1 and not hasattr(fake_quant, "learning_enabled")


def set_flag(fake_quant: nn.Module, flag: str, enabled: bool, setter: Any) -> None:
    """``setter(enabled)`` unless the flag buffer already holds it: on CPU a read costs a third of torch.ao's
    indexed write; on an accelerator the read would wait for the device, so the flag is written. A stock setter's
    write is done as a ``fill_`` (its indexed write costs ~8 us; the callback switches observers twice a step).

    Args:
        fake_quant: a fake-quant module with the flag buffer.
        flag: the buffer's name (``fake_quant_enabled``, ``observer_enabled``).
        enabled: the wanted value.
        setter: the module's own switch (``enable_fake_quant``, ``enable_observer``), which writes it.
    """
    buffer = fake_quant._buffers.get(flag)  # (a custom fake-quant class may keep its flag elsewhere)
    if buffer is not None and buffer.device.type == "cpu":
        if bool(buffer.item()) == enabled:
            return
        if getattr(setter, "__func__", None) in _PLAIN_FLAG_SETTERS:
            buffer.fill_(1 if enabled else 0)
            return
    setter(enabled)


def is_fused_fake_quant(m: nn.Module) -> bool:
    """torch.ao's or torchao's ``FusedMovingAvgObsFakeQuantize`` (or a subclass such as the default
    weight fake-quants, :class:`ZeroCenteredWeightRange`): the modules ``torch.fused_moving_avg_obs_fake_quant`` runs.

    Args:
        m: any module.
    """
    return any(c.__name__ == "FusedMovingAvgObsFakeQuantize" for c in type(m).__mro__)


def straddle_zero_(observer: nn.Module) -> None:
    """Make an observed ``min_val`` / ``max_val`` hold both signs (``min <= -tiny``, ``max >= tiny``), in place.

    The fused op (``ChooseQuantizationParams`` with ``preserve_sparsity``) centres a *symmetric* range on zero
    only when it straddles zero: a channel whose weights are all of one sign (min or max exactly 0, as after
    pruning) gets an affine zero point of -128 / 127 although the qscheme is symmetric. Measured: a pruned
    first conv kept 46 % zero int8 weights of 66 %; MiniLM PT2E int8 parted from its q/dq reference at 13.6 dB.
    Moving the zero end by the smallest normal float changes nothing else: a range that already straddles
    zero is left bit for bit, and an all-zero channel gets the op's 0.1 fallback scale with zero point 0.

    Args:
        observer: a min/max observer that has observed (finite ``min_val`` / ``max_val``).
    """
    tiny = torch.finfo(observer.min_val.dtype).tiny
    observer.min_val.clamp_(max=-tiny)
    observer.max_val.clamp_(min=tiny)


def straddles_zero(observer: nn.Module) -> bool:
    """Whether :func:`straddle_zero_` would leave ``observer``'s ``min_val`` / ``max_val`` as they are.

    Args:
        observer: a min/max observer.
    """
    min_val, max_val = observer._buffers["min_val"], observer._buffers["max_val"]
    tiny = torch.finfo(min_val.dtype).tiny
    if min_val.device.type == "cpu" and min_val.dtype in _NUMPY_FLOATS:
        # numpy on a weight's few hundred channels: ~3 us against ~20 for the four torch ops below, in every
        # observing step of every weight (most of it per-call dispatch: it weighs at batch 1)
        low, high = min_val.detach().numpy(), max_val.detach().numpy()
        return not (np.logical_or.reduce(low > -tiny) or np.logical_or.reduce(high < tiny))  # (ndarray.any: Python)
    return not bool(torch.logical_or(min_val > -tiny, max_val < tiny).any())


_NUMPY_FLOATS = (torch.float32, torch.float64)


def centres_on_zero(fq: nn.Module) -> bool:
    """Whether ``fq`` keeps its observed range straddling zero (:class:`ZeroCenteredWeightRange`, symmetric qscheme).

    Args:
        fq: a fake-quant module.
    """
    return getattr(fq, "straddles_zero", False) and fq.is_symmetric_quant


_ON = torch.ones(1, dtype=torch.long)
_OFF = torch.zeros(1, dtype=torch.long)


def fused_fake_quant(fq: nn.Module, X: torch.Tensor, observe: torch.Tensor, fake_quant: torch.Tensor) -> torch.Tensor:
    """``torch.fused_moving_avg_obs_fake_quant`` on ``fq``'s own buffers with the given flags.

    Args:
        fq: a fused moving-average fake-quant (:func:`is_fused_fake_quant`).
        X: the tensor to observe and/or fake-quantize.
        observe: 1-element long tensor, 1 to move the running min/max.
        fake_quant: 1-element long tensor, 1 to fake-quantize (else ``X`` is returned as a copy).
    """
    # buffers and the observer from the module dicts: nn.Module.__getattr__ costs 1-2 us a lookup, and the class's
    # own forward makes eleven of them per call, for every activation and weight of every step
    obs, buffers = fq._modules["activation_post_process"], fq._buffers
    return torch.fused_moving_avg_obs_fake_quant(
        X, observe, fake_quant, obs._buffers["min_val"], obs._buffers["max_val"], buffers["scale"],
        buffers["zero_point"], obs.averaging_constant, obs.quant_min, obs.quant_max, fq.ch_axis, fq.is_per_channel,
        fq.is_symmetric_quant,
    )


def fused_forward(fq: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """``FusedMovingAvgObsFakeQuantize.forward`` (torch.ao's and torchao's, the same code) through the module dicts:
    the same op on the same buffers with the module's own flags, without its eleven ``__getattr__`` calls
    (``tests/test_fast_qat.py`` checks both classes give the same outputs and state).

    Args:
        fq: a fused moving-average fake-quant (:func:`is_fused_fake_quant`).
        X: the input.
    """
    buffers = fq._buffers
    return fused_fake_quant(fq, X, buffers["observer_enabled"], buffers["fake_quant_enabled"])


def float_phase_forward(self: nn.Module, X: torch.Tensor) -> torch.Tensor:
    """A fused per-tensor fake-quant's forward that, with fake-quant off (the float warm-up), observes ``X``'s
    ``(min, max)`` as a 2-element tensor and returns ``X`` itself. The op on ``X`` would return a copy of it and
    build a ones mask for its backward, two full-size passes, for the same observer state (its own moving average
    of the same min and max) and the same gradient. Otherwise, the class's own forward.

    Args:
        X: the input.
    """
    if (X.device.type != "cpu" or X.dtype != torch.float32 or X.numel() == 0 or self.is_per_channel
            or centres_on_zero(self) or self._buffers["fake_quant_enabled"].item() == 1):  # (read on CPU only: no device wait)
        return type(self).forward(self, X)
    if self._buffers["observer_enabled"].item() == 1:
        with torch.no_grad():
            observe_min_max(self, X.detach())
    return X


def observe_min_max(fq: nn.Module, X: torch.Tensor, relu: bool = False) -> torch.Tensor:
    """Move a per-tensor fused fake-quant's running min/max by ``X`` (``relu(X)``) as the op does, in one pass.

    The op is fed ``(min, max)`` of ``X`` as a 2-element tensor: its aminmax of that is ``X``'s, so the moving
    average is the op's own, bit for bit, and the full-size copy and ones mask it returns with fake-quant off are
    two-element ones. ReLU is monotone: ``relu(X)``'s min/max are relu of ``X``'s, so ``relu(X)`` is never built.

    Args:
        fq: a fused moving-average fake-quant (:func:`is_fused_fake_quant`), per tensor.
        X: the tensor to observe (detached; the caller holds ``no_grad``).
        relu: observe ``relu(X)`` instead.

    Returns:
        The ``(min, max)`` pair observed.
    """
    lohi = torch.stack(torch.aminmax(dense_order(X)))
    if relu:
        lohi = torch.relu(lohi)
    fused_fake_quant(fq, lohi, _ON, _OFF)
    return lohi


def dense_order(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or a permuted view of it that is contiguous where one exists: the same elements in memory order.

    ``aminmax`` of a non-contiguous tensor (attention's transposed heads, a channels-last activation) first copies it
    to a contiguous one; a reduction over all elements does not depend on their order, so it can read the permuted
    view in place instead.

    Args:
        x: any tensor.
    """
    if x.is_contiguous():
        return x
    permuted = x.permute(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d))))
    return permuted if permuted.is_contiguous() else x


def lean_float_phase(module: nn.Module) -> int:
    """Give every fused per-tensor fake-quant of ``module`` :func:`float_phase_forward` (an instance attribute:
    ``deepcopy`` binds it to the copy, ``state_dict`` does not change); returns how many.

    Args:
        module: a QAT-prepared module.
    """
    count = 0
    for fq in module.modules():
        if is_fused_fake_quant(fq) and not fq.is_per_channel:
            fq.forward = types.MethodType(float_phase_forward, fq)
            count += 1
    return count


class ZeroCenteredWeightRange:
    """Mixin for a ``FusedMovingAvgObsFakeQuantize`` (torch.ao's or torchao's) that the default QAT
    mappings of both engines use for weights: a symmetric range always straddles zero (:func:`straddle_zero_`),
    so one-signed channels keep zero point 0 in training and in the int8 model.

    The default weight observers take the current weights' range at every step (``averaging_constant=1``):
    torch.ao's and torchao's 0.01 average trails the weights through the float warm-up (a fused conv-BN's
    folded weight grows ~3x as BatchNorm's running variance settles), so fake-quant clipped them from its
    first step, BatchNorm's running statistics stopped matching eval inputs, and a 3-epoch residual net fell
    from 98.5 % float to 10 % int8 (``notes/defaults.md``). Current ranges make one-signed channels common
    (a pruned filter), which is why the range must straddle zero. The fast and compiled FX paths do the same
    (``straddles_zero``). Classes, buffers and ``state_dict`` keys are the parent's.
    """

    straddles_zero = True

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        """The parent's forward; when observing a symmetric range, observe, straddle zero, then fake-quantize.

        Args:
            X: the weight (or tensor) to fake-quantize.
        """
        if not centres_on_zero(self) or self._buffers["observer_enabled"].item() != 1:
            return fused_forward(self, X)  # the parent's forward
        # observe and fake-quantize in one call, as the parent does; only where the observed range misses zero
        # (rare: a one-signed channel) straddle it and fake-quantize again with the observer off. Either way the
        # numbers of observing first, straddling, then fake-quantizing (the op computes scale / zero point from the
        # updated min/max in both), for one op call in most steps instead of two (small weights, e.g. at batch 1)
        fake_quant, observer = self._buffers["fake_quant_enabled"], self._modules["activation_post_process"]
        out = fused_fake_quant(self, X, _ON, fake_quant)
        if straddles_zero(observer):
            return out
        with torch.no_grad():
            straddle_zero_(observer)
        return fused_fake_quant(self, X, _OFF, fake_quant)


def current_range_weight_ctr(ctr: Any, zero_centered: type) -> Any:
    """The weight fake-quant constructor ``ctr`` (a ``with_args`` wrapper of a ``FusedMovingAvgObsFakeQuantize``)
    remade as ``zero_centered`` (its :class:`ZeroCenteredWeightRange` twin) over the current weights' range
    (``averaging_constant=1``); ``None`` when ``ctr`` is not a fused moving-average fake-quant.

    Args:
        ctr: torch.ao's or torchao's ``_PartialWrapper`` of the weight fake-quant.
        zero_centered: the class to build instead (a subclass of ``ctr``'s class).
    """
    partial = getattr(ctr, "p", None)
    if partial is None or "observer" not in partial.keywords or partial.func.__name__ != "FusedMovingAvgObsFakeQuantize":
        return None
    keywords = {**partial.keywords, "averaging_constant": 1.0}
    tracked = type(ctr)(functools.partial(zero_centered, *partial.args, **keywords))
    tracked.callable_args = dict(getattr(ctr, "callable_args", {}))
    return tracked


def settle_fake_quant_state(module: nn.Module) -> int:
    """Give every fused moving-average fake-quant of a freshly prepared ``module`` the state that its
    first forward would give it anyway, so that no later forward without observation changes a buffer.

    ``torch.fused_moving_avg_obs_fake_quant`` (torch.ao's and torchao's ``FusedMovingAvgObsFakeQuantize``)
    (a) sizes a per-channel fake-quant's empty ``min_val`` / ``max_val`` (to +-inf) and ``scale`` /
    ``zero_point`` (``resize_``, uninitialised) on its first call, whatever its flags, and (b) whenever
    fake-quant is on, rewrites ``scale`` / ``zero_point`` from the running min/max even with the
    observer off (0.1 / 0 while nothing was observed, torch.ao's construction value being 1.0 / 0).
    Measured on digits: the sanity check resized 12 buffers (FX) / 16 (PT2E) of the prepared net and
    moved scales 1.0 -> 0.1, although no observer ran. Here each is sized from the weight it quantizes
    and its scale / zero point are computed by the op itself (qparams only, on a one-element-per-channel
    dummy): those are exactly the values every later unobserved forward recomputes, bit for bit.
    Returns how many fake-quants were settled.

    Args:
        module: a freshly prepared module.
    """
    sizes = per_channel_counts(module)
    settled = 0
    for fq in module.modules():
        if not is_fused_fake_quant(fq):
            continue
        obs = fq.activation_post_process
        if fq.is_per_channel:
            channels = sizes.get(id(fq))
            if channels is None:
                continue  # input unknown here: the op sizes it on first use, as before
            if obs.min_val.numel() == 0:
                obs.min_val.resize_(channels).fill_(float("inf"))
                obs.max_val.resize_(channels).fill_(float("-inf"))
            if obs.min_val.numel() != channels:
                continue
            if fq.scale.numel() != channels:
                fq.scale.resize_(channels).fill_(1.0)
                fq.zero_point.resize_(channels).fill_(0)
            dummy = torch.zeros([channels if i == fq.ch_axis else 1 for i in range(max(fq.ch_axis + 1, 2))],
                                device=fq.scale.device)
        else:
            dummy = torch.zeros(1, device=fq.scale.device)
        if torch.isfinite(obs.min_val).any():
            continue  # already observed (a module prepared from a checkpoint): nothing to settle
        with torch.no_grad():
            torch.fused_moving_avg_obs_fake_quant(
                dummy, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), obs.min_val, obs.max_val,
                fq.scale, fq.zero_point, obs.averaging_constant, obs.quant_min, obs.quant_max, fq.ch_axis,
                fq.is_per_channel, fq.is_symmetric_quant,
            )
        settled += 1
    return settled


def _fused_op_qparams(fq: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale / zero point the fused op fake-quantizes with (it derives them from the running min/max on
    every call with fake-quant on, observer or not), computed on copies: the module is left untouched.
    Not the ``scale`` buffer itself: it is stale when the observer ran with fake-quant off (calibration)."""
    obs = fq.activation_post_process
    channels = obs.min_val.numel()
    if channels == 0 or not torch.isfinite(obs.min_val).any():
        return obs.calculate_qparams()  # never observed: as torch.ao / torchao
    scale = torch.ones(channels if fq.is_per_channel else 1, dtype=fq.scale.dtype, device=fq.scale.device)
    zero_point = torch.zeros_like(scale, dtype=fq.zero_point.dtype)
    shape = [channels if i == fq.ch_axis else 1 for i in range(max(fq.ch_axis + 1, 2))] if fq.is_per_channel else [1]
    with torch.no_grad():
        torch.fused_moving_avg_obs_fake_quant(
            torch.zeros(shape, device=scale.device), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long),
            obs.min_val.clone(), obs.max_val.clone(), scale, zero_point, obs.averaging_constant, obs.quant_min,
            obs.quant_max, fq.ch_axis, fq.is_per_channel, fq.is_symmetric_quant,
        )
    return scale, zero_point.to(torch.int64)  # the observer's dtypes


@contextlib.contextmanager
def trained_qparams(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within this block, a convert (``convert_fx``, ``convert_pt2e``) quantizes with the scale / zero
    point the fake-quant trained with.

    Both converts ask each fake-quant's ``calculate_qparams()``, which for
    ``FusedMovingAvgObsFakeQuantize`` is its *observer's* Python computation from the running min/max,
    while the fake-quant forward (training and the kept fake-quant model) uses the ``scale`` buffer that
    the fused C++ op computed. For per-channel symmetric int8 weights the two differ by 1/255 in every
    channel (measured on the digits CNN: max_abs / 128 vs / 127.5), so convert re-rounds nearly every
    weight (143 of 144 in the first conv): 33 dB int8 vs fake-quant after the first layer with
    activations emulated exactly. Activations differ by up to one float32 ulp. torchao's PT2E convert
    asks the same question of its own ``FusedMovingAvgObsFakeQuantize`` (digits CNN: 34-40 dB -> 80-200 dB). Here every fused
    fake-quant answers with what its forward uses, the fused op's qparams from its running min/max;
    restored on exit.

    Args:
        module: the prepared module about to be converted.
        enabled: ``False`` leaves the fake-quants' own ``calculate_qparams`` (the engine option ``trained_qparams=false``).
    """
    patched = []
    if enabled:
        for m in module.modules():
            if is_fused_fake_quant(m) and "calculate_qparams" not in m.__dict__:
                m.__dict__["calculate_qparams"] = (lambda m=m: _fused_op_qparams(m))
                patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            m.__dict__.pop("calculate_qparams", None)
