"""PTQ with equalization: the int8 baseline a QAT run shows beside its own, and the PTQ callback's core."""

from __future__ import annotations

import copy
import itertools
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from qlightning.core.inputs import Inputs, as_inputs
from qlightning.engines import QuantEngine, QuantSpec
from qlightning.engines.fx.ao import default_ptq_qconfig_mapping
from qlightning.quantize.calibration import spec_for_ptq, to_device, calibrate_and_convert
from qlightning.quantize.equalization import (
    cross_layer_equalization,
    input_weight_equalization_mapping,
    select_input_weight_equalization,
    selective_cross_layer_equalization,
    weight_sqnr,
)


def ptq_baseline(
    float_module: nn.Module,
    inputs: Iterable[Any],
    spec: Optional[QuantSpec] = None,
    *,
    engine: Union[str, QuantEngine] = "fx",
    num_batches: Optional[int] = None,
    qconfig_mapping: Any = None,
    equalization: Any = None,
    cross_layer_equalization: Union[bool, str] = False,
) -> nn.Module:
    """Static PTQ of a copy of a float module on given inputs: the int8 baseline next to QAT.

    Args:
        float_module: the float submodule (not modified; with BatchNorm running statistics).
        inputs: the submodule's inputs (``Inputs``, tensors, tuples or dicts); the first is also
            the example input for tracing. Only the first ``num_batches`` are used.
        spec: the QAT run's :class:`QuantSpec` (backend, custom configs). A QAT qconfig mapping is
            turned into its PTQ counterpart (:func:`qlightning.engines.fx.qconfigs.ptq_qconfig_mapping`);
            ``None`` = the backend's default PTQ mapping.
        engine: the engine's name or an instance.
        num_batches: how many of ``inputs`` to calibrate on; ``None`` for all.
        qconfig_mapping: a PTQ mapping to use instead.
        equalization: ``None``, ``"all"``, a list of layer names, ``"selective"`` or a
            ``QConfigMapping`` for FX input-weight equalization.
        cross_layer_equalization: ``True`` / ``"selective"``: data-free CLE on the copy first.

    Returns:
        the converted int8 module (the callback's ``backend``), on the device of the inputs.
    """
    spec = spec or QuantSpec(is_qat=False)
    device = next((p.device for p in float_module.parameters()), torch.device("cpu"))
    items = [as_inputs(to_device(i, device)) for i in itertools.islice(iter(inputs), num_batches)]
    module = copy.deepcopy(float_module).eval()
    spec = spec_for_ptq(spec, qconfig_mapping, None)
    apply_cle(module, cross_layer_equalization, spec)
    eq = equalization_mapping(module, equalization, items, spec, engine)
    return calibrate_and_convert(module, items, spec, engine=engine, equalization_config=eq)


def _weight_observer(spec: QuantSpec) -> Any:
    """The weight observer of the global qconfig the PTQ spec will use (for weight SQNR)."""
    mapping = spec.qconfig_mapping
    if mapping is None:
        mapping = default_ptq_qconfig_mapping(spec.backend)
    qconfig = getattr(mapping, "global_qconfig", None)
    return None if qconfig is None else qconfig.weight


def apply_cle(module: nn.Module, mode: Union[bool, str], spec: QuantSpec) -> Optional[Any]:
    """Data-free cross-layer equalization of ``module`` in place, as ``mode`` says.

    Args:
        module: the float module, changed in place.
        mode: ``True`` for full CLE, ``"selective"`` for :func:`selective_cross_layer_equalization`,
            anything else for none.
        spec: the PTQ spec whose global qconfig's weight observer the weight SQNR is measured with.

    Returns:
        The :class:`~qlightning.quantize.equalization.EqualizationResult` (with SQNR before/after), or
        ``None`` when nothing was done.
    """
    if mode is True:
        observer = _weight_observer(spec)
        before = weight_sqnr(module, observer)
        result = cross_layer_equalization(module)
        result.sqnr_before, result.sqnr_after = before, weight_sqnr(module, observer)
        return result
    if mode == "selective":
        return selective_cross_layer_equalization(module, _weight_observer(spec))
    return None


def equalization_mapping(module: nn.Module, how: Any, inputs: Sequence[Inputs], spec: QuantSpec,
                          engine: Union[str, QuantEngine], details: Optional[dict] = None) -> Any:
    """The FX input-weight equalization config PTQ should use for the ``equalization`` setting ``how``.

    Args:
        module: the float module (not modified).
        how: ``None``, ``"all"``, ``"selective"``, a list/tuple of layer names, or a ``QConfigMapping``
            (returned as is).
        inputs: the calibration inputs (for ``"selective"``).
        spec: the PTQ spec (for ``"selective"``).
        engine: the engine's name or an instance (for ``"selective"``).
        details: if given, updated with the SQNR figures ``"selective"`` measured.

    Returns:
        An equalization ``QConfigMapping``, or ``None`` for no equalization.
    """
    if how is None:
        return None
    if how == "all":
        return input_weight_equalization_mapping(module)
    if how == "selective":
        mapping, info = select_input_weight_equalization(module, inputs, spec, engine=engine)
        if details is not None:
            details.update(info)
        return mapping
    if isinstance(how, (list, tuple)):
        return input_weight_equalization_mapping(module, how)
    return how  # a QConfigMapping given as is
