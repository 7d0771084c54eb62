"""The FX engine's default QAT weight fake-quant: the current weights' range, centred on zero.

torch.ao's default QAT qconfigs fake-quantize weights with ``FusedMovingAvgObsFakeQuantize`` over a
``MovingAveragePerChannelMinMaxObserver`` that averages the range over steps (``averaging_constant=0.01``).
The default mappings here keep that class and qscheme but take the current weights' range at every step
(``averaging_constant=1``) and keep a symmetric range centred on zero for one-signed channels
(:class:`~qlightning.engines.base.ZeroCenteredWeightRange` says why, with the measurements).
A mapping a user writes keeps the observers it names.
"""

from __future__ import annotations

from typing import Any

from qlightning.engines.base import ZeroCenteredWeightRange, current_range_weight_ctr
from qlightning.engines.fx.ao import load_torch_ao, quiet_torch_ao

with quiet_torch_ao():
    from torch import nn
    from torch.ao.nn.intrinsic import qat as nniqat
    from torch.ao.quantization.fake_quantize import FusedMovingAvgObsFakeQuantize

_CONV_BN = (nniqat.ConvBn1d, nniqat.ConvBn2d, nniqat.ConvBn3d, nniqat.ConvBnReLU1d, nniqat.ConvBnReLU2d, nniqat.ConvBnReLU3d)
#: torch.ao's default weight averaging constant, kept outside conv-bn (see average_ranges_outside_conv_bn)
TORCH_AO_WEIGHT_AVERAGING = 0.01


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


def average_ranges_outside_conv_bn(module: nn.Module) -> int:
    """Give the default weight fake-quants of ``module``'s modules without a fused BatchNorm torch.ao's averaged
    range (``averaging_constant=0.01``) back; returns how many.

    The current range is what a fused conv-BN needs: its folded weight ``w * gamma / std`` grows as BatchNorm's
    running variance settles, and the averaged range trailed it (the short-run collapse, ``notes/defaults.md``).
    On plain Conv / Linear weights the current range parted int8 from the fake-quant model under FX where the
    averaged one did not (torchvision efficientnet_b0, zoo case: 200 dB with the averaged range, 18.4 dB with the
    current range at every weight, first departing layer an SE block's 1x1 conv; torchvision ViT 23.5 dB); the
    cause is not found yet, so those keep torch.ao's default. Zero-centring stays on for both.

    Args:
        module: a QAT-prepared FX module.
    """
    count = 0
    for m in module.modules():
        fq = getattr(m, "weight_fake_quant", None)
        if isinstance(fq, ZeroCenteredFusedFakeQuantize) and not isinstance(m, _CONV_BN):
            fq.activation_post_process.averaging_constant = TORCH_AO_WEIGHT_AVERAGING
            count += 1
    return count
