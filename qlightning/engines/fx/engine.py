"""The FX graph mode engine: torch.ao ``prepare_qat_fx`` / ``prepare_fx`` and ``convert_fx``.

FX graph mode quantization is deprecated upstream but still ships in torch 2.13/2.14. Where a
torch lacks it, constructing :class:`FxEngine` raises a clear
:class:`~qlightning.errors.EngineUnavailableError`; importing qlightning never fails because of it.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch
from torch import nn

from qlightning.core.inputs import Inputs, capture_inputs, positional_args
from qlightning.core.schedule import Phase
from qlightning.engines.base import (
    QuantEngine, QuantSpec, _fused_op_qparams, is_fused_fake_quant, keeps_last_observation, quantized_engine,
    refuse_zero_gammas, register_plain_flag_setters, set_flag, settle_fake_quant_state, trained_qparams,
)
from qlightning.engines.fx.attention import AttentionCore, split_multihead_attention, unsplit
from qlightning.engines.fx.ao import (
    AVERAGE_POOL_FUNCTIONS, AVERAGE_POOL_MODULES, backend_config_for, load_torch_ao, quiet_torch_ao,
    with_pool_observers,
)
from qlightning.engines.fx.prepare import faster_prepare
from qlightning.engines.fx.weights import average_ranges_outside_conv_bn, default_qat_qconfig_mapping
from qlightning.engines.fx.fast_fq import folds_dividing_by_zero_gammas, restore_fake_quant, swap_fake_quant
from qlightning.engines.fx.qconfig_builder import QConfigBuilder, check_against_model
from qlightning.engines.fx.qconfigs import clamp_quantized_weights
from qlightning.engines.fx.reference import CLAMP_META, reference_module
from qlightning.errors import ConfigError, TraceError



def narrow_activation_ranges(module: nn.Module) -> dict[tuple[float, int], tuple[int, int]]:
    """``{(scale, zero_point): (quant_min, quant_max)}`` of the per-tensor activation fake-quants (and
    observers) of a prepared ``module`` whose integer range is narrower than their dtype's.

    torch.ao's x86 / fbgemm qconfigs observe activations over [0, 127] (``reduce_range``). A
    ``(scale, zero_point)`` pair that two such modules share with different ranges is left out
    (ambiguous: :func:`clamp_activations` then leaves that tensor alone).

    Args:
        module: the prepared module; weight fake-quants and a fake-quant's own observer are skipped, and
            ranges that are the full uint8/int8 range are left out.
    """
    with quiet_torch_ao():
        from torch.ao.quantization import FakeQuantizeBase, ObserverBase
    found: dict[tuple[float, int], set[tuple[int, int]]] = {}
    for name, m in module.named_modules():
        if "weight_fake_quant" in name or not isinstance(m, (FakeQuantizeBase, ObserverBase)):
            continue
        if isinstance(m, ObserverBase) and "activation_post_process" in name.rsplit(".", 1)[-1] and \
                isinstance(module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else None, FakeQuantizeBase):
            continue  # a fake-quant's own observer: seen through the fake-quant
        obs = getattr(m, "activation_post_process", m)
        dtype, qmin, qmax = getattr(obs, "dtype", None), getattr(obs, "quant_min", None), getattr(obs, "quant_max", None)
        if dtype not in (torch.quint8, torch.qint8) or qmin is None or qmax is None:
            continue
        info = torch.iinfo(torch.uint8 if dtype == torch.quint8 else torch.int8)
        # convert_fx takes the observer's calculate_qparams(), which can differ from the fused op's
        # stored scale by one float32 ulp (measured on a ResNet block): both are keys
        keys = []
        try:
            keys.append(tuple(obs.calculate_qparams()))
        except Exception:  # noqa: BLE001 - an observer without statistics
            pass
        if isinstance(m, FakeQuantizeBase) and hasattr(m, "scale"):
            keys.append((m.scale, m.zero_point))
            if is_fused_fake_quant(m):
                keys.append(_fused_op_qparams(m))  # what convert quantizes with under trained_qparams
        for scale, zero_point in keys:
            if isinstance(scale, torch.Tensor) and scale.numel() == 1 and isinstance(zero_point, torch.Tensor):
                found.setdefault((float(scale), int(zero_point)), set()).add((int(qmin), int(qmax)))
    return {key: next(iter(r)) for key, r in found.items() if len(r) == 1 and next(iter(r)) not in ((0, 255), (-128, 127))}


def _quantized_output_qparams(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[tuple[float, int]]:
    """The ``(scale, zero_point)`` a node of a converted graph *chooses* for its quantized output: a
    quantized module (``scale`` / ``zero_point`` attributes), ``quantize_per_tensor``, or a quantized
    op taking them as ``get_attr`` arguments (``quantized::add``, ``cat``, ...). ``None`` for ops that
    inherit their input's qparams (pooling, flatten, relu): they cannot leave the input's range."""

    def attr(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value: Any = gm
            for part in str(arg.target).split("."):
                value = getattr(value, part)
            return value
        return arg

    if node.op == "call_module":
        m = gm.get_submodule(str(node.target))
        if type(m).__module__.startswith("torch.ao.nn.") and isinstance(getattr(m, "scale", None), (float, torch.Tensor)) \
                and hasattr(m, "zero_point") and ".quantized" in type(m).__module__:
            return float(m.scale), int(m.zero_point)
        return None
    if node.op != "call_function":
        return None
    args = [attr(a) for a in node.args]
    if node.target is torch.quantize_per_tensor and len(args) >= 3:
        return float(args[1]), int(args[2])
    if "quantized" in str(getattr(node.target, "__module__", "")) or str(node.target).startswith("quantized."):
        scale, zero_point = node.kwargs.get("scale", args[-2] if len(args) >= 2 else None), node.kwargs.get("zero_point", args[-1] if args else None)
        scale, zero_point = attr(scale), attr(zero_point)
        if isinstance(scale, (float, torch.Tensor)) and isinstance(zero_point, (int, torch.Tensor)) and not isinstance(zero_point, bool):
            if isinstance(scale, torch.Tensor) and scale.numel() != 1:
                return None
            return float(scale), int(zero_point)
    return None


def clamp_activations(gm: torch.fx.GraphModule, ranges: dict[tuple[float, int], tuple[int, int]]) -> int:
    """Clamp each quantized activation of a converted graph to the integer range its fake-quant used.

    Why (measured, benchmarks/fidelity.py, digits default job): x86's QAT qconfig fake-quantizes
    activations over [0, 127] (``reduce_range``) but ``convert_fx`` keeps only the scale / zero point, and
    the int8 kernels then fill the whole quint8 range 0..255. Whatever the frozen observers under-cover
    after the observer freeze (7.6 % of the logits above 127, 35 % below 0 on the default job) is
    clipped in training and not in the int8 model: int8 vs fake-quant logits 15.7 dB SQNR, first layer
    33 dB, after the 3rd conv 21 dB. Emulating the int8 range in the fake-quant model instead gives
    37.7 dB. Clamping int8 to the trained range (one ``quantized::clamp`` after every op that picks new
    qparams; pooling, flatten and relu cannot leave their input's range) makes the int8 model compute
    what training optimised, and keeps every int8 activation within 0..127, which is what ``reduce_range``
    is for: fbgemm's AVX2 u8 x s8 kernels (no VNNI; ``vpmaddubsw``) add pairs of products in int16 and
    saturate beyond 2 * 127 * 128 (measured here: 6.9 % of outputs wrong for random full-range
    activations, 0 % for 7-bit ones). Returns how many clamps were inserted.

    Args:
        gm: the converted graph, changed in place (recompiled if a clamp was inserted).
        ranges: ``{(scale, zero_point): (quant_min, quant_max)}`` of the fake-quants
            (:func:`narrow_activation_ranges`); outputs with other qparams are left alone.
    """
    count = 0
    for node in list(gm.graph.nodes):
        qparams = _quantized_output_qparams(gm, node)
        if qparams is None or qparams not in ranges:
            continue
        (scale, zero_point), (qmin, qmax) = qparams, ranges[qparams]
        with gm.graph.inserting_after(node):
            clamp = gm.graph.call_function(torch.clamp, (node,), {"min": (qmin - zero_point) * scale, "max": (qmax - zero_point) * scale})
        clamp.meta[CLAMP_META] = True  # part of the layer's requantization (qlightning.parity.layer_nodes)
        node.replace_all_uses_with(clamp, delete_user_cb=lambda user: user is not clamp)
        count += 1
    if count:
        gm.recompile()
    return count


def _static_custom_modules(config: Any) -> list[str]:
    """Observed -> quantized class names of the static custom module pairs of a ``ConvertCustomConfig``."""
    mapping = getattr(config, "observed_to_quantized_mapping", None) or {}
    with quiet_torch_ao():
        from torch.ao.quantization.quant_type import QuantType
    return sorted(f"{o.__module__}.{o.__qualname__} -> {q.__module__}.{q.__qualname__}" for o, q in (mapping.get(QuantType.STATIC) or {}).items())


def _has_dynamic_qconfig(mapping: Any) -> bool:
    """Whether any qconfig of a ``QConfigMapping`` quantizes activations dynamically."""
    if mapping is None:
        return False
    with quiet_torch_ao():
        from torch.ao.quantization.utils import activation_is_dynamically_quantized
    qconfigs = [getattr(mapping, "global_qconfig", None)]
    for attr in ("object_type_qconfigs", "module_name_qconfigs", "module_name_regex_qconfigs",
                 "module_name_object_type_order_qconfigs"):
        qconfigs += list((getattr(mapping, attr, None) or {}).values())
    return any(q is not None and activation_is_dynamically_quantized(q) for q in qconfigs)


_SPATIAL_DIMS = ((2, 3), (3, 2), (-2, -1), (-1, -2))


def _as_one_node(function: Any, args: tuple) -> Any:
    """While torch.fx traces ``function(*args)``, the call as one graph node instead of its body, else ``None``.

    A pickled GraphModule is traced again when it loads (torch.fx's ``KeepModules`` tracer: the int8 model sent
    back from a spawned process), and the helpers below branch on ``is_quantized``, which a proxy cannot answer.
    (``torch.fx.wrap`` patches only the defining module's name, not the one the generated code calls.)
    """
    proxy = next((a for a in args if isinstance(a, torch.fx.Proxy)), None)
    return None if proxy is None else proxy.tracer.create_proxy("call_function", function, args, {})


def global_spatial_mean(x: torch.Tensor, dims: List[int]) -> torch.Tensor:
    """``x.mean(dims)`` over the two spatial dims of an NCHW tensor, through average pooling when ``x`` is quantized.

    torch's quantized ``mean`` over dims [2, 3] of a 1x1 feature map (torchvision's ShuffleNetV2 at
    32x32 input, ``x.mean([2, 3])`` before ``fc``) raises "required rank 4 tensor to use channels_last
    format" (it keeps the input's channels_last layout for the rank-2 result). ``adaptive_avg_pool2d``
    to 1x1 then ``flatten`` computes the same mean with the same qparams. TorchScript-compatible.

    Args:
        x: the input tensor (quantized or float).
        dims: the dims to average over (used as is for a float or non-4-D tensor).
    """
    if not torch.jit.is_scripting():  # TorchScript compiles only the rest
        as_node = _as_one_node(global_spatial_mean, (x, dims))
        if as_node is not None:
            return as_node
    if x.is_quantized and x.dim() == 4:
        return torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1)
    return x.mean(dims)


def pool_spatial_means(gm: torch.fx.GraphModule) -> int:
    """Route ``mean`` over the spatial dims (keepdim false) of a converted graph through
    :func:`global_spatial_mean`; return how many nodes were rewritten.

    Args:
        gm: the converted graph, changed in place (recompiled if a node was rewritten).
    """
    count = 0
    for node in list(gm.graph.nodes):
        is_method = node.op == "call_method" and node.target == "mean"
        is_function = node.op == "call_function" and node.target is torch.mean
        if not (is_method or is_function) or len(node.args) != 2 or node.kwargs.get("keepdim", False):
            continue
        if set(node.kwargs) - {"keepdim"}:
            continue
        dims = node.args[1]
        if not isinstance(dims, (list, tuple)) or tuple(dims) not in _SPATIAL_DIMS:
            continue
        with gm.graph.inserting_after(node):
            pooled = gm.graph.call_function(global_spatial_mean, (node.args[0], list(dims)))
        pooled.meta = dict(node.meta)
        node.replace_all_uses_with(pooled)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


#: node meta key of a requantization the FX engine adds after an op (part of that layer's output, like a clamp)
REQUANTIZE_META = "qlightning_requantize"


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float (dequantized when it is a quantized tensor), contiguous. TorchScript-compatible.

    Contiguous: int8 convolutions return channels_last tensors, and a float pool sums a channels_last tensor in
    another order than the fake-quant model's contiguous one, which moves exact .5 means by an ulp either way.

    Args:
        x: a quantized or float tensor.
    """
    if not torch.jit.is_scripting():  # TorchScript compiles only the rest
        as_node = _as_one_node(dequantized, (x,))
        if as_node is not None:
            return as_node
    return x.dequantize().contiguous() if x.is_quantized else x


def requantized_like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Float ``y`` quantized with quantized ``x``'s (per-tensor) scale, zero point and dtype; ``y`` when ``x`` is float.

    Rounded by the fake-quant op (``y * (1 / scale)``, as training and the fake-quant model round) and only then
    stored: ``quantize_per_tensor`` divides by the scale, which rounds values within an ulp of .5 the other way.
    TorchScript-compatible.

    Args:
        y: the float result (e.g. a pool of ``x`` dequantized).
        x: the tensor whose qparams ``y`` takes (a pool shares its input's).
    """
    if not torch.jit.is_scripting():  # TorchScript compiles only the rest
        as_node = _as_one_node(requantized_like, (y, x))
        if as_node is not None:
            return as_node
    if x.is_quantized:
        scale, zero_point = x.q_scale(), x.q_zero_point()
        low, high = (0, 255) if x.dtype == torch.quint8 else (-128, 127)
        on_grid = torch.fake_quantize_per_tensor_affine(y, scale, zero_point, low, high)
        return torch.quantize_per_tensor(on_grid, scale, zero_point, x.dtype)
    return y


def requantized(x: torch.Tensor, scale: float, zero_point: int, low: float, high: float) -> torch.Tensor:
    """Quantized ``x`` requantized to ``scale`` / ``zero_point``, clamped to ``[low, high]`` first and rounded as the
    fake-quant op rounds; float ``x`` is returned as is. TorchScript-compatible.

    Args:
        x: the tensor to requantize.
        scale: the new scale.
        zero_point: the new zero point.
        low: the smallest value kept (the fake-quant's ``quant_min`` in real units).
        high: the largest value kept (its ``quant_max``).
    """
    if not torch.jit.is_scripting():  # TorchScript compiles only the rest
        as_node = _as_one_node(requantized, (x, scale, zero_point, low, high))
        if as_node is not None:
            return as_node
    if x.is_quantized:
        if x.q_scale() == scale and x.q_zero_point() == zero_point:  # activations are per-tensor in torch.ao
            # already on the grid (the usual case: torch.ao shares a cat's observer with its inputs): only the
            # range is left, clamped on the integers; the same values as below, without four passes over float
            # copies (shufflenet_v2's 32 concatenated branches: notes/perf.md)
            return torch.clamp(x, low, high)
        lowest, highest = (0, 255) if x.dtype == torch.quint8 else (-128, 127)
        on_grid = torch.fake_quantize_per_tensor_affine(torch.clamp(x.dequantize(), low, high), scale, zero_point,
                                                        lowest, highest)  # rounded as the fake-quant op rounds
        return torch.quantize_per_tensor(on_grid, scale, zero_point, x.dtype)
    return x


_AVERAGE_POOL_FUNCTIONS = (*AVERAGE_POOL_FUNCTIONS, global_spatial_mean)


def _is_average_pool(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), AVERAGE_POOL_MODULES)
    if node.op == "call_method":
        return node.target == "mean"
    return node.op == "call_function" and node.target in _AVERAGE_POOL_FUNCTIONS


def _requantize_after(gm: torch.fx.GraphModule, node: torch.fx.Node, function: Any, args: tuple) -> None:
    """Route every use of ``node`` through ``function(node, *args)``, marked as part of the layer's output."""
    with gm.graph.inserting_after(node):
        again = gm.graph.call_function(function, (node, *args))
    again.meta[REQUANTIZE_META] = True  # the layer's output is after it (qlightning.core.fidelity.layer_nodes)
    node.replace_all_uses_with(again, delete_user_cb=lambda user: user is not again)


def requantized_onto(y: torch.Tensor, x: torch.Tensor, scale: float, zero_point: int, low: float,
                     high: float) -> torch.Tensor:
    """Float ``y`` clamped to ``[low, high]`` and quantized to ``scale`` / ``zero_point`` in quantized ``x``'s dtype,
    rounded as the fake-quant op rounds; ``y`` when ``x`` is float. TorchScript-compatible.

    Args:
        y: the float result (e.g. a pool of ``x`` dequantized).
        x: the quantized tensor ``y`` was computed from (its dtype is kept).
        scale: the trained scale of ``y``'s own fake-quant.
        zero_point: its zero point.
        low: the smallest value kept (the fake-quant's ``quant_min`` in real units).
        high: the largest value kept (its ``quant_max``).
    """
    if not torch.jit.is_scripting():  # TorchScript compiles only the rest
        as_node = _as_one_node(requantized_onto, (y, x, scale, zero_point, low, high))
        if as_node is not None:
            return as_node
    if x.is_quantized:
        lowest, highest = (0, 255) if x.dtype == torch.quint8 else (-128, 127)
        on_grid = torch.fake_quantize_per_tensor_affine(torch.clamp(y, low, high), scale, zero_point, lowest, highest)
        return torch.quantize_per_tensor(on_grid, scale, zero_point, x.dtype)
    return y


def _pool_key(node: torch.fx.Node) -> str:
    """What names an average pool in both the prepared and the converted graph (convert keeps both)."""
    return str(node.target) if node.op == "call_module" else node.name


def average_pool_output_qparams(prepared: torch.fx.GraphModule) -> dict[str, tuple[float, int, float, float]]:
    """``{pool: (scale, zero_point, low, high)}`` of the fake-quant after each average pool / mean of a prepared graph
    that observes its own output (engine option ``pool_observers``) with other qparams than its input's (call inside
    :func:`trained_qparams`).

    Args:
        prepared: the prepared (fake-quant) GraphModule.
    """
    found = {}
    for node in prepared.graph.nodes:
        if not _is_average_pool(prepared, node) or not node.args:
            continue
        before = _per_tensor_fake_quant(prepared, node.args[0])
        for user in node.users:
            after = _per_tensor_fake_quant(prepared, user)
            if after is not None and after is not before and (
                    before is None or _per_tensor_qparams(after) != _per_tensor_qparams(before)):
                found[_pool_key(node)] = _per_tensor_qparams(after)
    return found


def float_average_pools(gm: torch.fx.GraphModule, own_qparams: Optional[dict[str, tuple[float, int, float, float]]] = None) -> int:
    """Run every average pool / mean of a converted graph in float on the dequantized input and requantize
    as the fake-quant model does: onto the pool's own trained qparams where it observed its own output
    (``own_qparams``), else onto its input's; returns how many were rewritten.

    Why (measured, zoo fits at 32x32): torch.ao quantizes average pools with their input's qparams (no
    observer of their own), and the fake-quant model rounds the float mean of the fake-quantized values to
    that grid, so an exact mean of .5 falls either way by one float ulp; ATen's channels_last quantized
    ``adaptive_avg_pool2d`` rounds the exact integer mean half to even. The 2x2 and 4x4 maps of
    squeeze-excitation blocks are ties a quarter / a sixteenth of the time: 60-85 % of those matched, each
    miss one whole channel's gate. Locally 22-48 dB at each SE pool, compounding to int8 vs fake-quant
    28.5 dB (efficientnet_b0) and 24.5 dB (mobilenet_v3_small); with float pools 35.1 and 45.5 dB. Costs
    efficientnet_b0 8.1 -> 8.5 ms at batch 1, 18.7 -> 20.3 ms at batch 32 (2 cores). A pool with an observer
    of its own (``with_pool_observers``) converts to the same quantized pool on its input's grid, dropping the
    trained one: requantizing onto the input's grid then rounds twice.

    Args:
        gm: the converted graph, changed in place (recompiled if a node was rewritten).
        own_qparams: :func:`average_pool_output_qparams` of the prepared graph it was converted from.
    """
    own_qparams = own_qparams or {}
    count = 0
    for node in list(gm.graph.nodes):
        if not _is_average_pool(gm, node) or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        source = node.args[0]
        with gm.graph.inserting_before(node):
            as_float = gm.graph.call_function(dequantized, (source,))
        node.args = (as_float, *node.args[1:])
        own = own_qparams.get(_pool_key(node))
        if own is None:
            _requantize_after(gm, node, requantized_like, (source,))
        else:
            _requantize_after(gm, node, requantized_onto, (source, *own))
        count += 1
    if count:
        gm.recompile()
    return count


_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
# modules whose int8 counterpart passes its quantized input through, although torch.ao may give them a fake-quant
# of their own with other qparams (a dropout's own observer; an Identity's output observer shared with a cat)
_PASS_THROUGH_MODULES = (*_DROPOUT_MODULES, nn.Identity)


def _per_tensor_qparams(fq: Any) -> tuple[float, int, float, float]:
    """``(scale, zero_point, low, high)`` of a per-tensor fake-quant, as convert quantizes with it."""
    scale, zero_point = (float(v.reshape(-1)[0]) for v in fq.calculate_qparams())
    low, high = int(fq.quant_min), int(fq.quant_max)
    return scale, int(zero_point), (low - zero_point) * scale, (high - zero_point) * scale


def _per_tensor_fake_quant(prepared: torch.fx.GraphModule, node: Any) -> Any:
    """The per-tensor fake-quant module ``node`` calls in a prepared graph, else ``None``."""
    from torch.ao.quantization import FakeQuantizeBase

    if not isinstance(node, torch.fx.Node) or node.op != "call_module":
        return None
    fq = prepared.get_submodule(str(node.target))
    return fq if isinstance(fq, FakeQuantizeBase) and not getattr(fq, "is_per_channel", False) else None


def pass_through_output_qparams(prepared: torch.fx.GraphModule) -> dict[str, tuple[float, int, float, float]]:
    """``{module: (scale, zero_point, low, high)}`` of the fake-quant after each pass-through module (dropouts,
    ``nn.Identity``) of a prepared graph whose int8 counterpart would not apply it: every dropout, and an
    Identity whose output fake-quant has other qparams than its input's (call inside :func:`trained_qparams`).

    Args:
        prepared: the prepared (fake-quant) GraphModule.
    """
    found = {}
    for node in prepared.graph.nodes:
        module = prepared.get_submodule(str(node.target)) if node.op == "call_module" else None
        if not isinstance(module, _PASS_THROUGH_MODULES):
            continue
        before = _per_tensor_fake_quant(prepared, node.args[0]) if node.args else None
        # a dropout always: its own observer saw the training outputs scaled by 1 / (1 - p)
        keep_if_equal = None if isinstance(module, _DROPOUT_MODULES) or before is None else _per_tensor_qparams(before)
        for user in node.users:
            after = _per_tensor_fake_quant(prepared, user)
            if after is not None and _per_tensor_qparams(after) != keep_if_equal:
                found[str(node.target)] = _per_tensor_qparams(after)
    return found


def requantize_pass_throughs(gm: torch.fx.GraphModule, qparams: dict[str, tuple[float, int, float, float]]) -> int:
    """After each pass-through module of a converted graph named in ``qparams``, requantize to the qparams and range
    of the fake-quant that followed it in training.

    Why (measured): torch.ao gives ``nn.Dropout`` an output observer of its own, which in training sees the
    outputs scaled by 1 / (1 - p) (efficientnet_b0's classifier: scale 0.0461 against 0.0386 at its input), so
    the fake-quant model re-rounds onto that coarser grid in eval; the int8 ``nnq.Dropout`` drops the scale and
    passes its input through. Locally 40.5 dB at efficientnet_b0's ``classifier.0``. An ``nn.Identity`` before a
    ``torch.cat`` (timm's ViT: ``patch_embed.norm``, then the class token is concatenated) gets the cat's shared
    observer (scale 0.036, range +-2.3 against 0.062, +-4.0 at its input); the int8 Identity passes its input
    through and the quantized ``cat`` requantizes it onto the first input's scale over the whole 0..255, not the
    trained 0..127: 15.7 dB there, int8 vs fake-quant 25.4 dB at the output. Returns how many were inserted.

    Args:
        gm: the converted graph, changed in place (recompiled if a node was inserted).
        qparams: :func:`pass_through_output_qparams` of the prepared graph it was converted from.
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or str(node.target) not in qparams:
            continue
        _requantize_after(gm, node, requantized, qparams[str(node.target)])
        count += 1
    if count:
        gm.recompile()
    return count


_CONCATENATIONS = (torch.cat, torch.concat, torch.concatenate)


def concatenation_output_qparams(prepared: torch.fx.GraphModule) -> dict[str, tuple[int, tuple[float, int, float, float]]]:
    """``{node name: (number of inputs, (scale, zero_point, low, high))}`` of the fake-quant after each ``torch.cat`` of
    a prepared graph (call inside :func:`trained_qparams`).

    Args:
        prepared: the prepared (fake-quant) GraphModule.
    """
    found = {}
    for node in prepared.graph.nodes:
        if node.op != "call_function" or node.target not in _CONCATENATIONS:
            continue
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        if not isinstance(tensors, (list, tuple)):
            continue
        for user in node.users:
            fq = _per_tensor_fake_quant(prepared, user)
            if fq is not None:
                found[node.name] = (len(tensors), _per_tensor_qparams(fq))
    return found


def _clamped_onto(gm: torch.fx.GraphModule, node: Any, trained: tuple[float, int, float, float]) -> bool:
    """Whether ``node`` is a :func:`clamp_activations` clamp to exactly ``trained``'s range after an op that chooses
    ``trained``'s scale and zero point (a cat input that shares the cat's observer, as torch.ao usually makes it)."""
    scale, zero_point, low, high = trained
    return (isinstance(node, torch.fx.Node) and node.meta.get(CLAMP_META, False) and node.target is torch.clamp
            and node.kwargs.get("min") == low and node.kwargs.get("max") == high and isinstance(node.args[0], torch.fx.Node)
            and _quantized_output_qparams(gm, node.args[0]) == (scale, zero_point))


def requantize_concatenated(gm: torch.fx.GraphModule, qparams: dict[str, tuple[int, tuple[float, int, float, float]]]) -> int:
    """Requantize each input of a converted graph's ``torch.cat`` to the qparams and range of the fake-quant after the
    cat in training (the prepared graph's node of the same name); returns how many cats were rewritten.

    Why (measured): torch.ao shares one observer between a cat and its inputs, but an input produced by an op that
    keeps its input's qparams (a reshape / permute after a conv: torchvision's ViT concatenates its class token to
    the patch embedding) arrives with other qparams. The quantized ``cat`` then requantizes it onto the first
    input's scale over the whole 0..255, not the trained range (0..127 under x86's reduce_range), and rounds by
    its own rule: torchvision's ViT read 200 dB after ``conv_proj`` and 31.6 dB after the cat.

    Args:
        gm: the converted graph, changed in place (recompiled if a cat was rewritten).
        qparams: :func:`concatenation_output_qparams` of the prepared graph it was converted from (a cat whose input
            count differs from the prepared one's of that name is left alone).
    """
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONCATENATIONS or node.name not in qparams:
            continue
        tensors = node.args[0] if node.args else node.kwargs.get("tensors")
        count_in, trained = qparams[node.name]
        if not isinstance(tensors, (list, tuple)) or len(tensors) != count_in or \
                not all(isinstance(t, torch.fx.Node) for t in tensors):
            continue  # not the cat of that name in the prepared graph
        again = []
        for t in tensors:
            if _clamped_onto(gm, t, trained):
                again.append(t)  # already on the trained qparams and range: requantizing would change nothing
                continue
            with gm.graph.inserting_before(node):
                step = gm.graph.call_function(requantized, (t, *trained))
            step.meta[REQUANTIZE_META] = True  # a quantization step, not a layer (qlightning.core.fidelity.layer_nodes)
            again.append(step)
        if all(a is t for a, t in zip(again, tensors)):
            continue
        node.args = (again, *node.args[1:]) if node.args else node.args
        if not node.args:
            node.kwargs = {**node.kwargs, "tensors": again}
        count += 1
    if count:
        gm.recompile()
    return count


def mode_dependent_modules(module: nn.Module) -> dict[str, type]:
    """``{name: class}`` of the submodules whose forward reads ``self.training`` in a way tracing bakes in.

    torchvision's ``StochasticDepth`` (EfficientNet, ConvNeXt, Swin) calls the FX-wrapped
    ``torchvision.ops.stochastic_depth(input, p, mode, self.training)``: a trace in train mode records
    ``training=True`` as a constant, so the prepared and the int8 model kept dropping residual
    branches at random in eval, and int8 vs fake-quant compared two random draws (efficientnet_b0:
    8 dB at 32x32). Only classes of modules already imported are looked for (nothing is imported).

    Args:
        module: the model whose submodules are searched.
    """
    import sys

    classes = []
    ops = sys.modules.get("torchvision.ops.stochastic_depth")
    if ops is not None and isinstance(getattr(ops, "StochasticDepth", None), type):
        classes.append(ops.StochasticDepth)
    if not classes:
        return {}
    return {name: type(m) for name, m in module.named_modules() if isinstance(m, tuple(classes))}


class FxEngine(QuantEngine):
    """torch.ao FX graph mode: fuse + trace + insert fake-quant, then ``convert_fx`` and lower.

    Example::

        engine = FxEngine()
        prepared = engine.prepare(net.train(), Inputs((torch.randn(1, 1, 8, 8),)), QuantSpec(backend="x86"))
        ...  # train
        int8 = engine.convert(prepared, QuantSpec(backend="x86"))
    """

    name = "fx"
    compiles_training = True
    ptq_modes = ("static", "dynamic", "weight_only")
    equalizes_inputs_and_weights = True
    keeps_module_names = True
    spawn_hand_over = True
    pickles_without_prepared = True  # their qconfigs hold a local function
    dry_run_by_default = True

    def converted_here(self, module: nn.Module) -> bool:
        """Whether ``module`` is this engine's int8 output: its graph quantizes tensors, or it holds
        ``torch.ao.nn.quantized`` modules.

        Args:
            module: the module to inspect.
        """
        for node in getattr(getattr(module, "graph", None), "nodes", ()):
            if node.op == "call_function" and node.target in (torch.quantize_per_tensor, torch.quantize_per_channel):
                return True
        return any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in module.modules())

    def __reduce__(self) -> tuple:
        # stateless apart from the torch modules it imports: pickle as "make a new one"
        return (type(self), ())

    def __init__(self) -> None:
        self.ao = load_torch_ao()
        register_plain_flag_setters(self.ao.FakeQuantizeBase.enable_observer, self.ao.FakeQuantizeBase.enable_fake_quant)
        # per prepared module: its fake-quants, conv-bn modules and BatchNorms, found once (the
        # callback applies a phase at every training batch; walking the module tree cost more than switching)
        self._parts: weakref.WeakKeyDictionary[nn.Module, _PhaseParts] = weakref.WeakKeyDictionary()

    def resolve_spec(self, spec: QuantSpec, errors: list[str]) -> QuantSpec:
        """Build torch.ao objects from the plain-data parts of ``spec`` (qconfig mapping, custom configs,
        backend config, ``equalization``) with :class:`QConfigBuilder`.

        Args:
            spec: the spec as given; its plain-data values are kept in ``options["plain"]``.
            errors: list that every problem is appended to (``equalization`` with QAT is one).

        Returns:
            A copy of ``spec`` with the built objects.
        """
        from dataclasses import replace

        def is_data(value: Any) -> bool:
            return value is None or isinstance(value, (str, dict, list)) or type(value).__module__.startswith("omegaconf")

        builder = QConfigBuilder(
            spec.backend, spec.is_qat, presets=spec.options.get("qconfig_presets"), trusted=spec.options.get("trusted", ())
        )
        data = {}
        resolved = {}
        for name, build, key in (
            ("qconfig_mapping", builder.qconfig_mapping, "qconfig_mapping"),
            ("prepare_custom_config", builder.prepare_custom_config, "prepare"),
            ("convert_custom_config", builder.convert_custom_config, "convert"),
        ):
            value = getattr(spec, name)
            if is_data(value) and value is not None:
                data[key] = value
                resolved[name] = build(value, name, errors)
        if isinstance(spec.backend_config, str):
            resolved["backend_config"] = builder.backend_config(spec.backend_config, "backend_config", errors)
        options = dict(spec.options)
        equalization = options.pop("equalization", None)
        if equalization is not None:
            if spec.is_qat:
                errors.append("equalization: input-weight equalization is applied by FX prepare_fx (PTQ) only; "
                              "prepare_qat_fx has no equalization config. Use it with PostTrainingQuantization.")
            else:
                options["equalization_config"] = builder.equalization_mapping(equalization, "equalization", errors) if is_data(equalization) else equalization
        options["plain"] = data
        return replace(spec, options=options, **resolved)

    def check_spec_against_model(self, spec: QuantSpec, modules: dict[str, nn.Module]) -> list[str]:
        """Plain-data config entries that match nothing in the quantized submodules (:func:`check_against_model`).

        Args:
            spec: a spec from :meth:`resolve_spec` (its ``options["plain"]`` is checked).
            modules: ``{name: submodule}`` of the modules to quantize.
        """
        return check_against_model(modules, spec.options.get("plain", {}))

    def default_qconfig_mapping(self, spec: QuantSpec) -> Any:
        """The backend's default mapping: qlightning's QAT mapping (:func:`default_qat_qconfig_mapping`), or
        torch.ao's default PTQ mapping.

        Args:
            spec: the spec (``backend``, ``is_qat``).
        """
        if spec.is_qat:
            return default_qat_qconfig_mapping(spec.backend)  # weights: current range, centred on zero
        with quiet_torch_ao():
            return self.ao.get_default_qconfig_mapping(spec.backend)

    def backend_config(self, spec: QuantSpec) -> Any:
        """``spec.backend_config`` if set, else torch.ao's ``BackendConfig`` of ``spec.backend``, average pools
        observing their own output unless the engine option ``pool_observers`` is false (:func:`with_pool_observers`).

        Args:
            spec: the spec.
        """
        if spec.backend_config is not None:
            return spec.backend_config
        config = backend_config_for(spec.backend)
        return with_pool_observers(config) if spec.options.get("pool_observers", True) else config

    def takes_quantized_inputs(self, spec: QuantSpec) -> bool:
        """Whether the prepare custom config sets ``input_quantized_indexes``.

        Args:
            spec: the spec (its ``prepare_custom_config``).
        """
        config = spec.prepare_custom_config
        return bool(getattr(config, "input_quantized_indexes", None))

    def export_limits(self, spec: QuantSpec) -> dict[str, str]:
        """``{what: why}`` of the exports (``reference``, ``onnx``, ``pt2``) this spec cannot have: static custom
        modules, or dynamically quantized activations.

        Args:
            spec: the resolved spec.
        """
        limits: dict[str, str] = {}
        static_custom = _static_custom_modules(spec.convert_custom_config)
        if static_custom:
            # measured on lstm_static: the decomposed reference hands the quantized LSTM float tensors
            # ("Could not run 'quantized::linear' ... from the 'CPU' backend") and torch.export cannot
            # capture its packed params
            reason = (f"the static custom module(s) {static_custom} run torch.ao's quantized kernels on quantized "
                      "tensors, which a float q/dq graph cannot express")
            limits.update(reference=reason, onnx=reason, pt2=reason)
        if _has_dynamic_qconfig(spec.qconfig_mapping):
            # the q/dq program then holds quantized_decomposed.choose_qparams (scales computed per call)
            limits.setdefault("onnx", "dynamic quantization computes its activation scales per call "
                                      "(quantized_decomposed.choose_qparams), which the ONNX exporter cannot translate")
            limits.setdefault("pt2", "dynamic quantization computes its activation scales per call, and the .pt2 "
                                     "writer needs constant q/dq parameters")
        return limits

    def reference_module(self, prepared: nn.Module, int8: nn.Module, spec: Optional[QuantSpec]) -> nn.Module:
        """The decomposed q/dq reference graph of ``prepared`` (:func:`~qlightning.engines.fx.reference.reference_module`).

        Args:
            prepared: the prepared (fake-quant) module; left untouched.
            int8: the converted module (its clamps say which activation ranges to keep).
            spec: the spec it was converted with (custom config, backend config, ``trained_qparams``);
                ``None`` uses torch.ao's defaults.
        """
        if spec is None:
            return reference_module(prepared, int8)
        return reference_module(prepared, int8, spec.convert_custom_config, self.backend_config(spec),
                                trained=spec.options.get("trained_qparams", True))

    def prepare(self, module: nn.Module, inputs: Inputs, spec: QuantSpec) -> nn.Module:
        """``prepare_qat_fx`` (QAT) or ``prepare_fx`` (PTQ) of ``module`` with the spec's mapping and configs.

        For QAT, the fast fake-quant forwards are swapped in (engine options ``fast_qat``, ``fast_conv_bn``,
        ``fast_linear``) and the fake-quant state is settled. A failure to trace raises
        :class:`~qlightning.errors.TraceError`.

        Args:
            module: the float module (put in train mode for QAT, eval for PTQ).
            inputs: example inputs of one call (bound to positions for tracing).
            spec: the resolved spec.

        Returns:
            The prepared GraphModule.
        """
        quantized_engine(spec.backend)
        gammas = {id(m.weight): name for name, m in module.named_modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.weight is not None}
        mapping = spec.qconfig_mapping if spec.qconfig_mapping is not None else self.default_qconfig_mapping(spec)
        prepare = self.ao.prepare_qat_fx if spec.is_qat else self.ao.prepare_fx
        module.train(spec.is_qat)
        config = self._with_standalone_inputs(module, inputs, spec.prepare_custom_config)
        # split after capturing the standalone modules' inputs (which runs the model as given)
        split = (split_multihead_attention(module, self._configured_wholes(module, mapping, config))
                 if spec.options.get("split_attention", True) else {})
        mapping = self._expand_regex(module, mapping)
        leaves = set(mode_dependent_modules(module).values()) if spec.options.get("leaf_mode_modules", True) else set()
        kwargs: dict[str, Any] = {
            "qconfig_mapping": mapping,
            "example_inputs": positional_args(module, inputs),
            "prepare_custom_config": self._with_leaves(config, leaves | ({AttentionCore} if split else set())),
            "backend_config": self.backend_config(spec),
        }
        if not spec.is_qat and spec.options.get("equalization_config") is not None:
            kwargs["_equalization_config"] = spec.options["equalization_config"]
        try:
            with quiet_torch_ao(), faster_prepare(spec.options.get("fast_prepare", True)):
                prepared = prepare(module, **kwargs)
        except BaseException as exc:
            unsplit(module, split)  # the caller's model as it was given
            if not isinstance(exc, (torch.fx.proxy.TraceError, TypeError, RuntimeError, NotImplementedError, AttributeError)):
                raise
            raise TraceError(
                f"FX could not trace {type(module).__name__}: {type(exc).__name__}: {exc}. "
                "Quantize a smaller submodule that traces (modules), skip the part that does not "
                "(prepare_custom_config: non_traceable_module_names / _classes), or run `qlightning doctor` for a diagnosis."
            ) from exc
        if spec.is_qat and spec.options.get("fast_qat", True):
            # vectorized fake-quant, ReLU fused into the fake-quant after it (both bit-identical to torch.ao),
            # conv-bn dividing the weight rather than the conv output (float rounding): see fast_fq.py
            swap_fake_quant(prepared, fake_quant=True, conv_bn=spec.options.get("fast_conv_bn", True), relu=True,
                            linear=spec.options.get("fast_linear", True))
        if spec.is_qat:
            try:  # gamma exactly 0 (zero-init residual BatchNorms) trains only where the fold takes the weight itself
                refuse_zero_gammas(
                    folds_dividing_by_zero_gammas(prepared, gammas), "torch.ao's QAT fold in these modules",
                    "Leave engine_options fast_qat and fast_conv_bn on (the engine's conv-bn fold convolves a channel of "
                    "gamma 0 with the weight itself, so gamma trains from 0 as in float; a Linear-BatchNorm pair has no "
                    "such fold)",
                )
            except ConfigError:
                unsplit(module, split)
                raise
            average_ranges_outside_conv_bn(prepared)  # current weight ranges where BatchNorm moves the weights
            settle_fake_quant_state(prepared)  # no evaluation before training may move a buffer (base.py)
        return prepared

    def compile_training(self, module: nn.Module, **compile_kwargs: Any) -> bool:
        """Training forwards through ``torch.compile`` with traceable fake-quants (``compiled.py``).

        Args:
            module: the prepared module; the fast fake-quant forwards are restored to torch.ao's first.
            compile_kwargs: keyword arguments of ``torch.compile``.
        """
        from qlightning.engines.fx.compiled import compile_for_training

        restore_fake_quant(module)  # the eager fast path reads flags on the host and packs masks with numpy
        compile_for_training(module, **compile_kwargs)
        return True

    def decompile(self, module: nn.Module) -> None:
        """Undo :meth:`compile_training` on ``module``.

        Args:
            module: the prepared module.
        """
        from qlightning.engines.fx.compiled import decompile

        decompile(module)
        if folds_dividing_by_zero_gammas(module):  # torch.ao's fold again, 0 / 0 where a gamma is still 0 (untrained)
            swap_fake_quant(module, fake_quant=False, conv_bn=True, relu=False, linear=False)

    @staticmethod
    def _expand_regex(module: nn.Module, mapping: Any) -> Any:
        """Also give each submodule a regex matches its own ``module_name`` entry.

        torch.ao applies ``module_name_regex`` qconfigs when it inserts observers but not when it
        swaps fused modules for their QAT versions, so a fused conv-bn-relu kept the global
        weight fake-quant. Explicit ``module_name`` entries keep their priority.
        """
        if not getattr(mapping, "module_name_regex_qconfigs", None):
            return mapping
        import re

        mapping = copy.copy(mapping)
        mapping.module_name_qconfigs = dict(mapping.module_name_qconfigs)
        for name, _ in module.named_modules():
            if not name or name in mapping.module_name_qconfigs:
                continue
            for regex, qconfig in mapping.module_name_regex_qconfigs.items():
                if re.match(regex, name):
                    mapping.module_name_qconfigs[name] = qconfig
                    break
        return mapping

    @staticmethod
    def _configured_wholes(module: nn.Module, mapping: Any, config: Any) -> set[str]:
        """Names of the modules a user's mapping or prepare config treats as wholes (``"*"``: every
        ``nn.MultiheadAttention``), which :func:`split_multihead_attention` leaves as they are."""
        wholes: set[str] = set()
        classes: set[type] = set()
        if nn.MultiheadAttention in (getattr(mapping, "object_type_qconfigs", None) or {}):
            wholes.add("*")  # a qconfig for the class itself
        if config is not None:
            wholes |= set(config.non_traceable_module_names) | set(config.standalone_module_names)
            classes |= set(config.non_traceable_module_classes) | set(config.standalone_module_classes)
            for observed in config.float_to_observed_mapping.values():
                classes |= set(observed)  # torch.ao's custom-module flow (quantizable.MultiheadAttention)
        wholes |= {name for name, m in module.named_modules() if name and type(m) in classes}
        return wholes

    @staticmethod
    def _with_leaves(config: Any, leaves: set[type]) -> Any:
        """``config`` with ``leaves`` added to its non-traceable classes: modules that stay float calls in the graph,
        the ones of :func:`mode_dependent_modules` (so their ``train()`` / ``eval()`` still switch them) and the
        attention cores of the split ``nn.MultiheadAttention`` modules."""
        classes = sorted(leaves, key=lambda c: c.__qualname__)
        if not classes:
            return config
        with quiet_torch_ao():
            from torch.ao.quantization.fx.custom_config import PrepareCustomConfig
        config = copy.copy(config) if config is not None else PrepareCustomConfig()
        config.non_traceable_module_classes = list(config.non_traceable_module_classes) + [
            c for c in classes if c not in config.non_traceable_module_classes
        ]
        return config

    def _with_standalone_inputs(self, module: nn.Module, inputs: Inputs, config: Any) -> Any:
        """Standalone modules are prepared with their own example inputs: capture them from a real forward."""
        if config is None:
            return None
        from dataclasses import replace

        wanted = [n for n, e in config.standalone_module_names.items() if e.example_inputs is None]
        by_class = {cls: next((n for n, m in module.named_modules() if isinstance(m, cls)), None)
                    for cls, e in config.standalone_module_classes.items() if e.example_inputs is None}
        targets = sorted(set(wanted) | {n for n in by_class.values() if n})
        if not targets:
            return config
        seen = capture_inputs(module, targets, lambda: module(*inputs.args, **inputs.kwargs))
        config = copy.copy(config)
        config.standalone_module_names = {
            n: replace(e, example_inputs=positional_args(module.get_submodule(n), seen[n])) if n in seen else e
            for n, e in config.standalone_module_names.items()
        }
        config.standalone_module_classes = {
            c: replace(e, example_inputs=positional_args(module.get_submodule(by_class[c]), seen[by_class[c]]))
            if by_class.get(c) in seen else e
            for c, e in config.standalone_module_classes.items()
        }
        return config

    def _phase_parts(self, module: nn.Module) -> "_PhaseParts":
        parts = self._parts.get(module)
        if parts is None:
            conv_bn = tuple(getattr(self.ao.nniqat, f"ConvBn{r}{d}d") for r in ("", "ReLU") for d in (1, 2, 3))
            members = list(module.modules())
            parts = _PhaseParts(
                fake_quants=tuple(m for m in members if isinstance(m, self.ao.FakeQuantizeBase)),
                weight_fake_quants=frozenset(id(fq) for m in members
                                             if isinstance(fq := getattr(m, "weight_fake_quant", None), self.ao.FakeQuantizeBase)),
                learnable=tuple(m for m in members if isinstance(m, self.ao.FakeQuantizeBase) and hasattr(m, "learning_enabled")),
                conv_bns=tuple(m for m in members if type(m) in conv_bn),  # what torch.ao's freeze_bn_stats acts on
                batch_norms=tuple(m for m in members if isinstance(m, nn.modules.batchnorm._BatchNorm)),
            )
            self._parts[module] = parts
        return parts

    def set_phase(self, module: nn.Module, phase: Phase) -> None:
        """Switch fake-quant, observers (and LSQ qparam learning) and BatchNorm statistics to ``phase``.

        Args:
            module: the prepared module.
            phase: the phase to apply; with ``bn_frozen``, unfused BatchNorms are put in eval mode too; with
                ``rest_memoryless_weights``, the weight fake-quants whose observer keeps only its last observation
                do not observe (the float warm-up's conv-bn weights by default: warm-up step 1.22x -> 1.11x float).
        """
        parts = self._phase_parts(module)
        for m in parts.fake_quants:
            # the fast path's cached scales / zero points go with every phase or observer change: the callback
            # makes one after each buffer broadcast (DDP), which writes them without a version bump
            m.__dict__.pop("_qlightning_cache", None)
            set_flag(m, "fake_quant_enabled", phase.fake_quant, m.enable_fake_quant)
            rests = phase.rest_memoryless_weights and id(m) in parts.weight_fake_quants and keeps_last_observation(m)
            set_flag(m, "observer_enabled", phase.observe and not rests, m.enable_observer)
        for m in parts.learnable:
            # _LearnableFakeQuantize (LSQ): observers estimate scale/zero point until they freeze,
            # from then on the optimizer learns them.
            m.toggle_qparam_learning(phase.fake_quant and not phase.observe)
        for m in parts.conv_bns:
            if m.freeze_bn == phase.bn_frozen and m._modules["bn"].training != phase.bn_frozen:
                continue  # already so (the switches below cost two nn.Module.__setattr__ each)
            if phase.bn_frozen:
                m.freeze_bn_stats()
            else:
                m.update_bn_stats()
        if phase.bn_frozen:  # BatchNorms that were not fused into a conv: eval mode keeps running stats fixed
            for m in parts.batch_norms:
                m.eval()

    def set_observers(self, module: nn.Module, enabled: bool) -> None:
        """Turn every fake-quant's observer on or off.

        Args:
            module: the prepared module.
            enabled: whether observers update.
        """
        for m in self._phase_parts(module).fake_quants:
            m.__dict__.pop("_qlightning_cache", None)  # as in set_phase
            set_flag(m, "observer_enabled", enabled, m.enable_observer)

    def convert(self, module: nn.Module, spec: QuantSpec) -> nn.Module:
        """``convert_fx`` of the prepared module, then weights clamped to their fake-quant range, activations
        clamped to the trained range (``clamp_activations``), spatial means pooled (``pool_spatial_means``), and
        average pools, dropouts, identities and concatenations requantized as the fake-quant model does (``requantize_as_trained``:
        :func:`float_average_pools`, :func:`requantize_pass_throughs`, :func:`requantize_concatenated`).

        Args:
            module: the prepared module (decompiled and put in eval mode).
            spec: the resolved spec (backend, convert custom config, engine options).

        Returns:
            The int8 GraphModule.
        """
        quantized_engine(spec.backend)
        self.decompile(module)
        module.eval()
        # convert_fx clamps weights to the int8 storage range only, not to a narrower
        # quant_min/quant_max: after QAT with frozen weight observers a 4-bit model would keep
        # weights up to +-14 (measured). Clamp to each layer's weight fake-quant range.
        ranges = {
            name: (int(m.weight_fake_quant.quant_min), int(m.weight_fake_quant.quant_max))
            for name, m in module.named_modules() if hasattr(m, "weight_fake_quant")
        }
        narrowed = narrow_activation_ranges(module)
        as_trained = spec.options.get("requantize_as_trained", True)
        with quiet_torch_ao(), trained_qparams(module, spec.options.get("trained_qparams", True)):
            is_graph = as_trained and isinstance(module, torch.fx.GraphModule)
            pass_throughs = pass_through_output_qparams(module) if is_graph else {}
            concatenations = concatenation_output_qparams(module) if is_graph else {}
            pools = average_pool_output_qparams(module) if is_graph else {}
            converted = self.ao.convert_fx(
                module,
                convert_custom_config=spec.convert_custom_config,
                backend_config=self.backend_config(spec),
            )
        names = dict(converted.named_modules())
        for name, (low, high) in ranges.items():
            if name in names and (low, high) != (-128, 127):
                clamp_quantized_weights(names[name], low, high)
        if narrowed and spec.options.get("clamp_activations", True):
            clamp_activations(converted, narrowed)
        if as_trained:  # first: a float mean needs no pooling (pool_spatial_means), and keeps its prepared name
            float_average_pools(converted, pools)
        if spec.options.get("pool_spatial_means", True):
            pool_spatial_means(converted)
        if as_trained:
            requantize_pass_throughs(converted, pass_throughs)
            requantize_concatenated(converted, concatenations)
        return converted

    def quant_state(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, buffer)`` of every buffer of the fake-quants and observers of ``module``.

        Args:
            module: the prepared module.
        """
        for name, m in module.named_modules():
            if isinstance(m, (self.ao.FakeQuantizeBase, self.ao.ObserverBase)):
                for buf_name, buf in m.named_buffers(prefix=name):
                    yield buf_name, buf

    def describe_qparams(self, module: nn.Module) -> dict[str, dict[str, Any]]:
        """``{fake-quant name: {scale_mean, zero_point_mean, fake_quant, observer}}`` of ``module``.

        Args:
            module: the prepared module.
        """
        summary = {}
        for name, m in module.named_modules():
            if isinstance(m, self.ao.FakeQuantizeBase) and hasattr(m, "scale"):
                scale = m.scale.detach().float()
                summary[name] = {
                    "scale_mean": float(scale.mean()),
                    "zero_point_mean": float(m.zero_point.detach().float().mean()),
                    "fake_quant": bool(m.fake_quant_enabled[0]),
                    "observer": bool(m.observer_enabled[0]),
                }
        return summary


@dataclass(frozen=True)
class _PhaseParts:
    """What a phase switches in one prepared module (:meth:`FxEngine._phase_parts`)."""

    fake_quants: tuple[nn.Module, ...]
    weight_fake_quants: frozenset[int]  # ids of the fake-quants that are a module's weight_fake_quant
    learnable: tuple[nn.Module, ...]  # fake-quants that learn their scale / zero point (LSQ)
    conv_bns: tuple[nn.Module, ...]
    batch_norms: tuple[nn.Module, ...]
