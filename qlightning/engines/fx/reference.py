"""The FX engine's q/dq reference graph: what the lowered int8 model computes, as float ops on int tensors.

``_convert_to_reference_decomposed_fx`` turns the fake-quant model into ``quantized_decomposed``
quantize/dequantize ops around float conv/linear: the graph ``torch.export`` and ONNX can capture
(the lowered int8 model's packed-params script objects cannot be exported). It quantizes with the
trained qparams and the activation ranges the int8 model keeps (see ``FxEngine.convert``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from qlightning.engines.base import trained_qparams
from qlightning.engines.fx.ao import quiet_torch_ao

#: node meta key of the FX engine's clamp of an activation to its fake-quant range (``FxEngine.convert``)
CLAMP_META = "qlightning_activation_clamp"


def quantized_decomposed_ops() -> Any:
    """``torch.ops.quantized_decomposed``, registered by importing torch.ao's decomposed op library."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401  registers torch.ops.quantized_decomposed

    return torch.ops.quantized_decomposed


def _overloads(packet: Any) -> set[Any]:
    return {getattr(packet, name) for name in packet.overloads()}


def full_range_activations(gm: torch.fx.GraphModule) -> int:
    """Give every per-tensor quantize/dequantize the full range of its dtype; returns how many changed.

    The lowered FX int8 model stores activations as quint8/qint8 tensors over the whole dtype range;
    ``reduce_range`` (x86/fbgemm qconfigs observe over [0, 127]) only shrinks the scale. The decomposed
    reference graph keeps the observer's range and would clip where the int8 model does not.

    Args:
        gm: the decomposed reference graph, changed in place and recompiled.
    """
    qd = quantized_decomposed_ops()
    per_tensor = _overloads(qd.quantize_per_tensor) | _overloads(qd.dequantize_per_tensor)
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in per_tensor and len(node.args) >= 6:
            dtype = node.args[5]
            if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
                info = torch.iinfo(dtype)
                if (node.args[3], node.args[4]) != (info.min, info.max):
                    node.args = (*node.args[:3], info.min, info.max, *node.args[5:])
                    changed += 1
    gm.recompile()
    return changed


def reference_module(
    fake_quant: nn.Module, int8: nn.Module, convert_custom_config: Any = None, backend_config: Any = None,
    trained: bool = True,
) -> nn.Module:
    """The decomposed q/dq reference graph of (a copy of) a prepared FX module, observers off.

    The same qparams and activation ranges as ``FxEngine.convert`` gives the int8 model: the trained
    scales, and activations clamped to the fake-quant's range where ``int8`` clamps (else, with engine
    option ``clamp_activations=false``, int8 fills its dtype's whole range and so must the reference).

    Args:
        fake_quant: the prepared (fake-quant) GraphModule; left untouched.
        int8: the converted module (its clamp nodes say which activation ranges it keeps).
        convert_custom_config: the ``ConvertCustomConfig`` the int8 model was converted with.
        backend_config: the ``BackendConfig`` it was converted for (``None``: torch.ao's native one).
        trained: quantize with the fake-quants' trained qparams (engine option ``trained_qparams``).
    """
    from torch.ao.quantization import FakeQuantizeBase
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx

    module = copy.deepcopy(fake_quant).eval()
    with quiet_torch_ao():
        for m in module.modules():
            if isinstance(m, FakeQuantizeBase):
                m.disable_observer()
        with trained_qparams(module, trained):
            reference = _convert_to_reference_decomposed_fx(
                module, convert_custom_config=convert_custom_config, backend_config=backend_config
            )
    graph = getattr(int8, "graph", None)
    if not any(n.meta.get(CLAMP_META) for n in getattr(graph, "nodes", ())):  # int8 kept its dtype's full range
        full_range_activations(reference)
    return reference.eval()
