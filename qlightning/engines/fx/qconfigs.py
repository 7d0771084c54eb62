"""torch.ao QConfig / QConfigMapping helpers for the Python API: low-bit weights, dynamic and
weight-only post-training quantization, and the PTQ counterpart of a QAT mapping.

These are the Python-side twins of the plain-data builders in :mod:`qlightning.engines.fx.qconfig_builder`
(whose ``w4a8`` preset is the same idea in YAML). Everything here returns native torch.ao objects
that :class:`~qlightning.QuantizationAwareTraining` and
:class:`~qlightning.callbacks.ptq.PostTrainingQuantization` accept as ``qconfig_mapping=``.

Low-bit weights are stored in int8 (``torch.qint8``) with a narrower integer range
(``quant_min``/``quant_max``), so the FX converter and the x86/fbgemm/qnnpack/onednn int8 kernels
run them unchanged; only the values are restricted to, e.g., ``[-7, 7]`` for 4 bits.

Example::

    from qlightning.engines.fx.qconfigs import low_bit_qconfig_mapping

    qat = QuantizationAwareTraining(qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=4, is_qat=True))
    ptq = PostTrainingQuantization(qconfig_mapping=low_bit_qconfig_mapping("x86", weight_bits=4))
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from torch import nn

from qlightning.engines.fx.ao import backend_config_for, quiet_torch_ao
from qlightning.engines.fx.weights import default_qat_qconfig_mapping
from qlightning.errors import ConfigError

#: module types dynamic / weight-only quantization applies to by default
DYNAMIC_TYPES: tuple[type, ...] = (nn.Linear, nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell, nn.RNNCell)
#: module types that get int8 weight-only (float qparams) quantization in dynamic / weight-only mode
EMBEDDING_TYPES: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag)
DYNAMIC_MODES = ("dynamic", "weight_only")


def _tq() -> Any:
    

    with quiet_torch_ao():
        from torch.ao import quantization as tq
    return tq


def weight_range(bits: int, narrow_range: bool = True) -> tuple[int, int]:
    """Signed integer range of ``bits``-bit weights: ``[-(2^(b-1)-1), 2^(b-1)-1]`` when
    ``narrow_range`` (symmetric, so the largest weight is not clipped), else ``[-2^(b-1), 2^(b-1)-1]``.

    Args:
        bits: the weight bit width.
        narrow_range: leave out the most negative value so the range is symmetric.
    """
    half = 2 ** (bits - 1)
    return (-(half - 1) if narrow_range else -half), half - 1


def _check_bits(errors: list[str], weight_bits: Any, activation_bits: Any) -> None:
    if not isinstance(weight_bits, int) or isinstance(weight_bits, bool) or not 2 <= weight_bits <= 8:
        errors.append(f"weight_bits={weight_bits!r}: must be an integer in [2, 8] (weights are stored as int8)")
    if not isinstance(activation_bits, int) or isinstance(activation_bits, bool) or not 2 <= activation_bits <= 8:
        errors.append(f"activation_bits={activation_bits!r}: must be an integer in [2, 8] (activations are stored as uint8)")


def low_bit_qconfig(
    weight_bits: int = 4,
    activation_bits: int = 8,
    *,
    per_channel: bool = True,
    is_qat: bool = False,
    backend: str = "x86",
    narrow_range: bool = True,
    activation_observer: str = "histogram",
    reduce_range: Optional[bool] = None,
    weight_averaging_constant: float = 1.0,
) -> Any:
    """A torch.ao ``QConfig`` with ``weight_bits``-bit symmetric weights and ``activation_bits``-bit activations.

    Args:
        weight_bits: 2..8; weights are qint8 restricted to :func:`weight_range`.
        activation_bits: 2..8; activations are quint8 restricted to ``[0, 2^bits - 1]``.
        per_channel: per-output-channel symmetric weight scales (else one scale per tensor).
        is_qat: fake-quant modules for QAT (``FusedMovingAvgObsFakeQuantize`` over moving-average
            min/max observers, as torch.ao's default QAT qconfig) instead of PTQ observers.
        backend: ``x86``/``fbgemm`` need 7-bit activations when weights use the full int8 range
            (their u8 x s8 kernels add pairs of products in int16: 2 * 255 * 128 overflows); with
            weights of 7 bits or fewer the sum cannot overflow, so activations keep all 8 bits
            (``reduce_range=None`` decides this). ``qnnpack`` needs scales >= 2^-12.
        narrow_range: see :func:`weight_range`.
        activation_observer: PTQ only: ``"histogram"`` (torch.ao's x86 default, minimizes the
            quantization error) or ``"minmax"``.
        reduce_range: force the activation range to be halved (``None``: decided as above).
        weight_averaging_constant: QAT only: moving-average constant of the weight range
            (1.0 = the current weights' range at every step; torch.ao's default is 0.01).
    """
    errors: list[str] = []
    _check_bits(errors, weight_bits, activation_bits)
    if activation_observer not in ("histogram", "minmax"):
        errors.append(f"activation_observer={activation_observer!r}: valid choices: ['histogram', 'minmax']")
    if errors:
        raise ConfigError(errors)
    tq = _tq()
    wmin, wmax = weight_range(weight_bits, narrow_range)
    amax = 2**activation_bits - 1
    if reduce_range is None:  # u8 x s8 pairs summed in int16 must not overflow
        reduce_range = backend in ("x86", "fbgemm") and 2 * amax * max(-wmin, wmax) > 32767
    if reduce_range:
        amax = (amax + 1) // 2 - 1
    extra: dict[str, Any] = {"eps": 2.0**-12} if backend == "qnnpack" else {}
    w_scheme = torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric
    weight_kwargs = dict(dtype=torch.qint8, qscheme=w_scheme, quant_min=wmin, quant_max=wmax, **extra)
    act_kwargs = dict(dtype=torch.quint8, qscheme=torch.per_tensor_affine, quant_min=0, quant_max=amax, **extra)
    if is_qat:
        # Weights: the plain FakeQuantize, whose scale is the observer's calculate_qparams() --
        # the scale convert_fx uses. The fused kernel of FusedMovingAvgObsFakeQuantize computes
        # symmetric scales differently once quant_min/quant_max are narrowed (measured 7% apart
        # at [-7, 7]), so training and the int8 model would disagree. averaging_constant=1: the
        # range is the current weights' range (as in PTQ); a lagging moving average clips weights
        # in fake-quant that convert_fx does not clip (it does not clamp to quant_min/quant_max).
        w_obs = tq.MovingAveragePerChannelMinMaxObserver if per_channel else tq.MovingAverageMinMaxObserver
        return tq.QConfig(
            activation=tq.FusedMovingAvgObsFakeQuantize.with_args(observer=tq.MovingAverageMinMaxObserver, **act_kwargs),
            weight=tq.FakeQuantize.with_args(observer=w_obs, averaging_constant=weight_averaging_constant, **weight_kwargs),
        )
    w_obs = tq.PerChannelMinMaxObserver if per_channel else tq.MinMaxObserver
    a_obs = tq.HistogramObserver if activation_observer == "histogram" else tq.MinMaxObserver
    return tq.QConfig(activation=a_obs.with_args(**act_kwargs), weight=w_obs.with_args(**weight_kwargs))


def low_bit_qconfig_mapping(
    backend: str = "x86",
    weight_bits: int = 4,
    activation_bits: int = 8,
    *,
    per_channel: bool = True,
    is_qat: bool = False,
    narrow_range: bool = True,
    activation_observer: str = "histogram",
    reduce_range: Optional[bool] = None,
    weight_averaging_constant: float = 1.0,
    check: bool = True,
) -> Any:
    """The backend's default ``QConfigMapping`` with :func:`low_bit_qconfig` as the global qconfig.

    Operators with fixed quantization parameters (sigmoid, tanh, softmax ...) and the other
    special entries of the backend's default mapping keep their defaults (ConvTranspose and
    LayerNorm stay 8-bit). With ``check`` (default), raises :class:`ConfigError` if the backend
    config would silently leave Conv2d or Linear in float with this qconfig.

    Args:
        backend: the backend whose default mapping is the base (QAT: qlightning's default QAT mapping).
        weight_bits: see :func:`low_bit_qconfig`.
        activation_bits: see :func:`low_bit_qconfig`.
        per_channel: see :func:`low_bit_qconfig`.
        is_qat: see :func:`low_bit_qconfig`.
        narrow_range: see :func:`low_bit_qconfig`.
        activation_observer: see :func:`low_bit_qconfig`.
        reduce_range: see :func:`low_bit_qconfig`.
        weight_averaging_constant: see :func:`low_bit_qconfig`.
        check: raise if the backend would leave Conv2d or Linear in float.
    """
    qconfig = low_bit_qconfig(
        weight_bits, activation_bits, per_channel=per_channel, is_qat=is_qat, backend=backend,
        narrow_range=narrow_range, activation_observer=activation_observer, reduce_range=reduce_range,
        weight_averaging_constant=weight_averaging_constant,
    )
    tq = _tq()
    

    if is_qat:
        base = default_qat_qconfig_mapping(backend)
    else:
        with quiet_torch_ao():
            base = tq.get_default_qconfig_mapping(backend)
    mapping = base.set_global(qconfig)
    if check:
        unsupported = unsupported_types(qconfig, backend, (nn.Conv2d, nn.Linear))
        if unsupported:
            raise ConfigError(
                f"weight_bits={weight_bits}, activation_bits={activation_bits}: backend {backend!r} does not accept "
                f"this qconfig for {[t.__name__ for t in unsupported]} (its BackendConfig constraints), so they "
                "would stay float; use backend='x86' or change the bit widths"
            )
    return mapping


def unsupported_types(qconfig: Any, backend: str, module_types: Iterable[type]) -> list[type]:
    """Module types whose pattern in ``backend``'s BackendConfig rejects ``qconfig`` (would stay float).

    Args:
        qconfig: the ``QConfig`` to check.
        backend: the backend whose ``BackendConfig`` is asked.
        module_types: the module classes to check (a class without a pattern is not reported).
    """
    from torch.ao.quantization.fx.qconfig_mapping_utils import _is_qconfig_supported_by_dtype_configs

    config = backend_config_for(backend)
    patterns = {c.pattern: c for c in config.configs if c.pattern is not None}
    return [
        t for t in module_types
        if t in patterns and not _is_qconfig_supported_by_dtype_configs(qconfig, patterns[t].dtype_configs)
    ]


def dynamic_qconfig_mapping(mode: str = "dynamic", module_types: Optional[Sequence[type]] = None) -> Any:
    """QConfigMapping for dynamic or weight-only PTQ with FX (``prepare_fx`` + ``convert_fx``).

    * ``"dynamic"``: int8 weights, activations quantized on the fly per batch
      (``default_dynamic_qconfig``) for Linear / LSTM / GRU / RNN cells;
    * ``"weight_only"``: float16 weights, float compute (``float16_dynamic_qconfig``) for the same types.

    In both modes Embedding / EmbeddingBag get int8 weight-only quantization
    (``float_qparams_weight_only_qconfig``). Nothing else is quantized (global qconfig ``None``).

    Args:
        mode: ``"dynamic"`` or ``"weight_only"``; anything else raises :class:`ConfigError`.
        module_types: the types to quantize instead of ``DYNAMIC_TYPES`` (embeddings are added either way).
    """
    if mode not in DYNAMIC_MODES:
        raise ConfigError(f"mode={mode!r}: valid dynamic modes: {list(DYNAMIC_MODES)}")
    tq = _tq()
    qconfig = tq.default_dynamic_qconfig if mode == "dynamic" else tq.float16_dynamic_qconfig
    mapping = tq.QConfigMapping()
    for t in module_types or DYNAMIC_TYPES:
        mapping.set_object_type(t, qconfig)
    for t in EMBEDDING_TYPES:
        mapping.set_object_type(t, tq.float_qparams_weight_only_qconfig)
    return mapping


def quantize_dynamic_eager(module: nn.Module, mode: str = "dynamic", module_types: Optional[Sequence[type]] = None) -> nn.Module:
    """Eager-mode ``torch.ao.quantization.quantize_dynamic`` (no tracing), for models FX cannot trace.

    Same choices as :func:`dynamic_qconfig_mapping`; returns a new module (the input is not modified).

    Args:
        module: the float module.
        mode: ``"dynamic"`` or ``"weight_only"``; anything else raises :class:`ConfigError`.
        module_types: the types to quantize instead of ``DYNAMIC_TYPES`` (embeddings are added either way).
    """
    if mode not in DYNAMIC_MODES:
        raise ConfigError(f"mode={mode!r}: valid dynamic modes: {list(DYNAMIC_MODES)}")
    tq = _tq()
    qconfig = tq.default_dynamic_qconfig if mode == "dynamic" else tq.float16_dynamic_qconfig
    spec: dict[Any, Any] = {t: qconfig for t in (module_types or DYNAMIC_TYPES)}
    spec.update({t: tq.float_qparams_weight_only_qconfig for t in EMBEDDING_TYPES})
    

    with quiet_torch_ao():
        return tq.quantize_dynamic(module, qconfig_spec=spec, inplace=False)


# ---------------------------------------------------------------------- converted weights


def quantized_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The quantized weight tensor of every converted Conv/Linear (static or dynamic) in ``module``.

    Args:
        module: the converted module; submodules with packed weights (``weight()`` and ``set_weight_bias``) count.

    Returns:
        ``{submodule name: quantized weight}``.
    """
    out = {}
    for name, m in module.named_modules():
        weight = getattr(m, "weight", None)
        if callable(weight) and hasattr(m, "set_weight_bias"):
            try:
                w = weight()
            except Exception:  # noqa: BLE001 - not a packed-weight module after all
                continue
            if isinstance(w, torch.Tensor) and w.is_quantized:
                out[name] = w
    return out


def weight_int_range(module: nn.Module) -> dict[str, tuple[int, int]]:
    """(min, max) of the stored integers of every converted weight: the bits a model really uses.

    Args:
        module: the converted module (see :func:`quantized_weights`).
    """
    return {n: (int(w.int_repr().min()), int(w.int_repr().max())) for n, w in quantized_weights(module).items()}


def clamp_quantized_weights(module: nn.Module, quant_min: int, quant_max: int) -> int:
    """Clamp the stored integers of every converted weight to ``[quant_min, quant_max]``, in place.

    ``convert_fx`` quantizes weights with the observer's scale but clamps only to the int8
    storage range, not to a narrower ``quant_min``/``quant_max``: after QAT with frozen weight
    observers a "4-bit" model can hold weights up to +-127. Returns how many values were clamped.

    Args:
        module: the converted module (or one converted layer); its packed weights are replaced.
        quant_min: the lowest stored integer kept.
        quant_max: the highest stored integer kept.
    """
    clamped = 0
    for name, w in quantized_weights(module).items():
        m = module.get_submodule(name)
        ints = w.int_repr()
        new = ints.clamp(quant_min, quant_max)
        n = int((new != ints).sum())
        if not n:
            continue
        clamped += n
        if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            qw = torch._make_per_channel_quantized_tensor(
                new, w.q_per_channel_scales(), w.q_per_channel_zero_points(), w.q_per_channel_axis()
            )
        else:
            qw = torch._make_per_tensor_quantized_tensor(new, w.q_scale(), w.q_zero_point())
        bias = m.bias() if callable(getattr(m, "bias", None)) else None
        m.set_weight_bias(qw, bias)
    return clamped


# ---------------------------------------------------------------------- QAT -> PTQ

_PTQ_OBSERVER = {
    "MovingAverageMinMaxObserver": "MinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver": "PerChannelMinMaxObserver",
}
_FAKE_QUANT_ONLY = ("observer", "scale", "zero_point", "use_grad_scaling", "channel_len", "averaging_constant")


def _observer_of(factory: Any) -> Any:
    """PTQ observer factory for one activation/weight entry of a QAT qconfig (fake-quant -> observer)."""
    tq = _tq()
    partial = getattr(factory, "p", None)
    func = getattr(partial, "func", factory)
    if not (isinstance(func, type) and issubclass(func, tq.FakeQuantizeBase)):
        return factory  # already an observer (or a class): usable as it is
    keywords = dict(getattr(partial, "keywords", {}) or {})
    observer = keywords.get("observer", tq.MovingAverageMinMaxObserver)
    kwargs = {k: v for k, v in keywords.items() if k not in _FAKE_QUANT_ONLY}
    obs_func = getattr(getattr(observer, "p", None), "func", observer)
    name = getattr(obs_func, "__name__", "")
    if name in _PTQ_OBSERVER:
        obs_kwargs = dict(getattr(getattr(observer, "p", None), "keywords", {}) or {})
        obs_kwargs.pop("averaging_constant", None)
        return getattr(tq, _PTQ_OBSERVER[name]).with_args(**{**obs_kwargs, **kwargs})
    return observer.with_args(**kwargs) if kwargs else observer


def ptq_qconfig(qconfig: Any) -> Any:
    """The PTQ counterpart of a QAT ``QConfig``: each fake-quant replaced by its observer
    (moving-average min/max observers by plain min/max ones), same dtypes and ranges.

    Args:
        qconfig: the QAT ``QConfig``; ``None`` gives ``None``, and observer entries are kept as they are.
    """
    if qconfig is None:
        return None
    tq = _tq()
    return tq.QConfig(activation=_observer_of(qconfig.activation), weight=_observer_of(qconfig.weight))


def ptq_qconfig_mapping(mapping: Any) -> Any:
    """The PTQ counterpart of a QAT ``QConfigMapping`` (see :func:`ptq_qconfig`), entry by entry.

    Args:
        mapping: the QAT ``QConfigMapping`` (not modified).
    """
    tq = _tq()
    out = tq.QConfigMapping().set_global(ptq_qconfig(mapping.global_qconfig))
    for key, qc in mapping.object_type_qconfigs.items():
        out.set_object_type(key, ptq_qconfig(qc))
    for key, qc in mapping.module_name_regex_qconfigs.items():
        out.set_module_name_regex(key, ptq_qconfig(qc))
    for key, qc in mapping.module_name_qconfigs.items():
        out.set_module_name(key, ptq_qconfig(qc))
    for (name, obj, index), qc in mapping.module_name_object_type_order_qconfigs.items():
        out.set_module_name_object_type_order(name, obj, index, ptq_qconfig(qc))
    return out


__all__ = [
    "DYNAMIC_MODES",
    "clamp_quantized_weights",
    "quantized_weights",
    "weight_int_range",
    "DYNAMIC_TYPES",
    "EMBEDDING_TYPES",
    "dynamic_qconfig_mapping",
    "low_bit_qconfig",
    "low_bit_qconfig_mapping",
    "ptq_qconfig",
    "ptq_qconfig_mapping",
    "quantize_dynamic_eager",
    "unsupported_types",
    "weight_range",
]
