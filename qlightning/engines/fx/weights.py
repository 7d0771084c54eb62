"""The FX engine's default QAT weight fake-quant: the current weights' range, centred on zero.

torch.ao's default QAT qconfigs fake-quantize weights with ``FusedMovingAvgObsFakeQuantize`` over a
``MovingAveragePerChannelMinMaxObserver`` that averages the range over steps (``averaging_constant=0.01``).
The default mappings here keep that class and qscheme but take the current weights' range at every step
(``averaging_constant=1``), on every weight, and keep a symmetric range centred on zero for one-signed channels
(:class:`~qlightning.engines.base.ZeroCenteredWeightRange` says why, with the measurements). Until stop 24 plain
Conv / Linear weights kept torch.ao's averaged range; the digits matrix at 12 epochs (``notes/defaults.md``) puts the
current range on every weight ahead (cells beyond 3 points of float: 0 of 30 against 2) and the zoo cannot tell
them apart (seed to seed noise).
A mapping a user writes keeps the observers it names.
"""

from __future__ import annotations

from typing import Any

from qlightning.engines.base import ZeroCenteredWeightRange, current_range_weight_ctr
from qlightning.engines.fx.ao import load_torch_ao, quiet_torch_ao

with quiet_torch_ao():
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize


class ZeroCenteredFusedFakeQuantize(ZeroCenteredWeightRange, FusedMovingAvgObsFakeQuantize):
    """torch.ao's ``FusedMovingAvgObsFakeQuantize`` whose symmetric range always straddles zero.

    Args:
        observer: the observer class (keyword arguments below are passed to it), as for the parent.
        quant_min: smallest integer value.
        quant_max: largest integer value.
        **observer_kwargs: the observer's arguments (``dtype``, ``qscheme``, ``averaging_constant``, ...).

    Example::

        weight = ZeroCenteredFusedFakeQuantize.with_args(
            observer=MovingAveragePerChannelMinMaxObserver, averaging_constant=1.0, quant_min=-128,
            quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric)
    """


def tracking_current_weights(qconfig: Any) -> Any:
    """``qconfig`` with its fused weight fake-quant made a :class:`ZeroCenteredFusedFakeQuantize` over the
    current weights' range (``averaging_constant=1``); any other weight fake-quant, or ``None``, is returned as is.

    Args:
        qconfig: a torch.ao ``QConfig`` (or ``None``).
    """
    weight = getattr(qconfig, "weight", None)
    if getattr(getattr(weight, "p", None), "func", None) is not FusedMovingAvgObsFakeQuantize:
        return qconfig
    tracked = current_range_weight_ctr(weight, ZeroCenteredFusedFakeQuantize)
    return qconfig if tracked is None else type(qconfig)(activation=qconfig.activation, weight=tracked)


def default_qat_qconfig_mapping(backend: str) -> Any:
    """torch.ao's default QAT ``QConfigMapping`` of ``backend`` with :func:`tracking_current_weights` weights.

    Args:
        backend: ``x86``, ``fbgemm``, ``qnnpack`` or ``onednn``.
    """
    with quiet_torch_ao():
        mapping = load_torch_ao().get_default_qat_qconfig_mapping(backend)
    mapping.global_qconfig = tracking_current_weights(mapping.global_qconfig)
    for table in (mapping.object_type_qconfigs, mapping.module_name_regex_qconfigs, mapping.module_name_qconfigs,
                  mapping.module_name_object_type_order_qconfigs):
        for key, qconfig in table.items():
            table[key] = tracking_current_weights(qconfig)
    return mapping


def default_qat_qconfig(backend: str) -> Any:
    """The global qconfig of :func:`default_qat_qconfig_mapping`.

    Args:
        backend: ``x86``, ``fbgemm``, ``qnnpack`` or ``onednn``.
    """
    with quiet_torch_ao():
        return tracking_current_weights(load_torch_ao().get_default_qat_qconfig(backend))
