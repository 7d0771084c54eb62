"""The q/dq program of a converted submodule: ``torch.export`` of its q/dq reference graph, int8 weights folded.

Engine-neutral: the FX engine builds its reference graph (``QuantEngine.reference_module``), PT2E's
converted module already is one; everything after that (constant folding, the ATen rewrite, the
ONNX and ``.pt2`` writers) lives here once, for the exporters and the lowering candidates alike.
See :mod:`qlightning.run.export` for why each route was chosen.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from qlightning.core.inputs import Inputs, flat_tensors, positional_args
from qlightning.core.quiet import quiet
from qlightning.engines import quantized_decomposed_ops
from qlightning.errors import QLightningError


class ExportError(QLightningError, RuntimeError):
    """An artifact could not be written, or does not load; the message says which and why."""


def quiet_export() -> Any:
    """Silence what torch.export / torch.onnx print on every call (progress lines, torchvision notes)."""
    return quiet(
        loggers=("torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export", "torch._export",
                 "onnxscript", "onnx_ir"),
        all_warnings=True,
        stdout=True,
    )


def input_names(module: nn.Module, count: int) -> list[str]:
    """Names of the first ``count`` parameters of ``module.forward`` (``x`` for the digits CNN).

    Args:
        module: the module whose ``forward`` signature names the inputs (positional parameters only).
        count: how many names; those the signature lacks are ``input_<i>``.
    """
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = params[:count]
    return names + [f"input_{i}" for i in range(len(names), count)]


def export_args(args: Sequence[Any], dynamic_batch: bool) -> tuple[tuple[Any, ...], Optional[tuple[Any, ...]]]:
    """Example args for ``torch.export`` and ``dynamic_shapes`` marking dim 0 (the batch) as symbolic.

    Tensors whose dim 0 has the batch size of the first tensor share one ``Dim``. A batch of 1 is
    repeated to 2 (export specializes sizes 0 and 1).

    Args:
        args: the positional example inputs (tensors are cloned).
        dynamic_batch: mark dim 0 as symbolic; if false (or no tensor has a dim), ``dynamic_shapes`` is ``None``.

    Returns:
        ``(args, dynamic_shapes)``.
    """
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)  # .pt2 files keep sample inputs
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0]
    if not dynamic_batch or not tensors:
        return args, None
    batch = tensors[0].shape[0]
    out, shapes = [], []
    dim = torch.export.Dim("batch", min=1)
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == batch:
            out.append(a.repeat(2, *([1] * (a.dim() - 1))) if batch == 1 else a.clone())  # no view of a dataset
            shapes.append({0: dim})
        else:
            out.append(a)
            shapes.append(None)
    return tuple(out), tuple(shapes)


def _overloads(packet: Any) -> set[Any]:
    return {getattr(packet, name) for name in packet.overloads()}


def _op_sets() -> dict[str, set[Any]]:
    qd = quantized_decomposed_ops()
    return {
        "q_tensor": _overloads(qd.quantize_per_tensor),
        "dq_tensor": _overloads(qd.dequantize_per_tensor),
        "q_channel": _overloads(qd.quantize_per_channel),
        "dq_channel": _overloads(qd.dequantize_per_channel),
    }


def _fetch_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _unique_attr(gm: nn.Module, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}{i}"):
        i += 1
    return f"{base}{i}"


def _remove_unused_attrs(gm: torch.fx.GraphModule) -> None:
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    for kind in ("parameters", "buffers"):
        for full, _ in list(getattr(gm, f"named_{kind}")()):
            if full in used or any(u.startswith(full + ".") for u in used):
                continue
            owner_name, _, attr = full.rpartition(".")
            owner = gm.get_submodule(owner_name) if owner_name else gm
            if attr in owner._parameters:
                del owner._parameters[attr]
            elif attr in owner._buffers:
                del owner._buffers[attr]


def fold_constants(gm: torch.fx.GraphModule, keep: Callable[[torch.fx.Node], bool]) -> int:
    """Evaluate ATen/q-dq calls whose inputs are all constants into buffers (weight quantization -> int8).

    Nodes for which ``keep`` is true (dequantize ops) stay in the graph. Returns the number folded.

    Args:
        gm: the graph, changed in place (folded values become buffers, unused attributes are removed).
        keep: true for a node that must not be folded.
    """
    values: dict[torch.fx.Node, Any] = {}
    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            values[node] = _fetch_attr(gm, node.target)
            continue
        if node.op != "call_function" or keep(node) or not isinstance(node.target, torch._ops.OpOverload):
            continue
        inputs = node.all_input_nodes
        if not inputs or any(i not in values for i in inputs):
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: values[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: values[n])
        try:
            with torch.no_grad():
                result = node.target(*args, **kwargs)
        except Exception:
            continue
        if not isinstance(result, torch.Tensor):
            continue
        source = next((i.target for i in inputs if i.op == "get_attr"), "const")
        attr = _unique_attr(gm, source.replace(".", "_") + "_q")
        gm.register_buffer(attr, result.detach().clone())
        with gm.graph.inserting_before(node):
            replacement = gm.graph.get_attr(attr)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        values[replacement] = getattr(gm, attr)
        folded += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _remove_unused_attrs(gm)
    return folded


def _dequantize_weight(w: torch.Tensor, zero_point: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.to(torch.float32) - zero_point) * scale


def _fake_quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    # the arithmetic of quantized_decomposed.quantize/dequantize_per_tensor, in core ATen ops only
    # (aten.fake_quantize_per_tensor_affine lowers to a cachemask op that torch.export cannot trace)
    if zero_point == 0:
        return torch.clamp(torch.round(x * (1.0 / scale)), quant_min, quant_max) * scale
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zero_point, quant_min, quant_max)
    return (q - zero_point) * scale


def _constant(gm: torch.fx.GraphModule, node: Any) -> Any:
    if isinstance(node, torch.fx.Node):
        if node.op != "get_attr":
            raise ExportError(f"pt2_ops=aten: q/dq parameter {node.name} is computed, not a constant")
        return _fetch_attr(gm, node.target)
    return node


def _buffer_node(gm: torch.fx.GraphModule, value: torch.Tensor, before: torch.fx.Node) -> torch.fx.Node:
    attr = _unique_attr(gm, "_qlightning_qparam_")
    gm.register_buffer(attr, value)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(attr)


def to_aten(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite quantized_decomposed q/dq ops to core ATen (loadable without torch.ao), in place.

    ``quantize_per_tensor -> dequantize_per_tensor`` becomes ``round(x / scale) + zp``, clamped, dequantized
    (the same arithmetic), ``dequantize_per_channel/tensor`` of an int8 constant becomes ``(w - zp) * scale``.

    Args:
        gm: the q/dq graph; its q/dq parameters must be constants, and every quantize must feed only
            dequantize nodes, else :class:`~qlightning.errors.ExportError` is raised.

    Returns:
        ``gm`` itself.
    """
    ops = _op_sets()
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ops["q_tensor"]:
            x, scale, zp, qmin, qmax = node.args[:5]
            users = list(node.users)
            if not users or any(u.target not in ops["dq_tensor"] for u in users):
                raise ExportError(
                    f"pt2_ops=aten: quantize node {node.name} feeds {[u.name for u in users]}, not only dequantize "
                    "nodes; export with export.pt2_ops=quantized_decomposed instead"
                )
            scale, zp = float(_constant(gm, scale)), int(_constant(gm, zp))
            qmin, qmax = int(_constant(gm, qmin)), int(_constant(gm, qmax))
            with graph.inserting_before(node):
                fq = graph.call_function(_fake_quantize, (x, scale, zp, qmin, qmax))
            fq.meta = dict(node.meta)
            for user in users:
                user.replace_all_uses_with(fq)
                graph.erase_node(user)
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ops["dq_channel"] | ops["dq_tensor"]:
            w, scale, zp = node.args[:3]
            scale_t = torch.as_tensor(_constant(gm, scale), dtype=torch.float32)
            zp_t = torch.as_tensor(_constant(gm, zp)).to(torch.float32)
            if node.target in ops["dq_channel"]:
                axis, ndim = int(_constant(gm, node.args[3])), len(_constant(gm, w).shape)
                shape = [-1 if i == axis else 1 for i in range(ndim)]
                scale_t, zp_t = scale_t.reshape(shape), zp_t.reshape(shape)
            scale_n = _buffer_node(gm, scale_t.clone(), node)
            zp_n = _buffer_node(gm, zp_t.clone(), node)
            with graph.inserting_before(node):
                new = graph.call_function(_dequantize_weight, (w, zp_n, scale_n))
        elif node.target in ops["q_channel"] or node.target in ops["q_tensor"]:
            raise ExportError(f"pt2_ops=aten: unsupported quantize node {node.name} ({node.target})")
        else:
            continue
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    leftovers = [n.name for n in graph.nodes if n.op == "call_function" and "quantized_decomposed" in str(n.target)]
    if leftovers:
        raise ExportError(f"pt2_ops=aten: could not rewrite {leftovers}; use export.pt2_ops=quantized_decomposed")
    graph.eliminate_dead_code()
    gm.recompile()
    _remove_unused_attrs(gm)
    return gm


@dataclass
class QdqProgram:
    """The q/dq exported program of one submodule (int8 weights folded) and what describes it."""

    program: Any  # torch.export.ExportedProgram
    args: tuple[Any, ...]
    dynamic_shapes: Optional[tuple[Any, ...]]
    input_names: list[str]
    output_names: list[str]


def explicit_activation_clamps(gm: torch.fx.GraphModule) -> int:
    """A narrower-than-dtype per-tensor quantize (x86 ``reduce_range``: 0..127) -> a quantize over the dtype's
    full range, a dequantize, a float clamp to the narrow range and a full-range quantize again; returns how
    many changed.

    The same numbers (the clamp bounds are integer multiples of the scale, so the clamp is one of the
    integers), but ONNX ``QuantizeLinear`` has no quant_min/quant_max: the exporter drops them and
    onnxruntime clamps to 0..255 (measured: onnx vs int8 13.5 dB on digits once int8 clamps to the trained
    range). An explicit clamp (ONNX ``Clip``) survives every route. It goes after a first full-range
    quantize so that the producer still ends in a quantize: onnxruntime fuses ``DequantizeLinear -> Conv ->
    QuantizeLinear`` into ``QLinearConv`` only then; a clamp between the conv and its quantize left every
    conv of an x86 model in float (digits CNN at batch 32: 2.1-2.3 ms against 1.1-1.2 ms fused).

    Args:
        gm: the q/dq graph, changed in place (recompiled if anything changed).
    """
    qd = quantized_decomposed_ops()
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not qd.quantize_per_tensor.default or len(node.args) < 6:
            continue
        x, scale, zero_point, qmin, qmax, dtype = node.args[:6]
        if not isinstance(scale, float) or not isinstance(zero_point, int) or not isinstance(dtype, torch.dtype):
            continue
        info = torch.iinfo(dtype)
        if (qmin, qmax) == (info.min, info.max):
            continue
        full = (scale, zero_point, info.min, info.max, dtype)
        with gm.graph.inserting_before(node):
            wide = gm.graph.call_function(qd.quantize_per_tensor.default, (x, *full))
            wide = gm.graph.call_function(qd.dequantize_per_tensor.default, (wide, *full))
            clamp = gm.graph.call_function(torch.ops.aten.clamp.default, (wide, (qmin - zero_point) * scale, (qmax - zero_point) * scale))
        node.args = (clamp, *full, *node.args[6:])
        changed += 1
    if changed:
        gm.recompile()
    return changed


_CONVOLUTIONS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default,
                 torch.ops.aten.convolution.default)


def clamps_before_quantize(gm: torch.fx.GraphModule) -> int:
    """:func:`explicit_activation_clamps`' chains in the form inductor fuses: the float clamp before one quantize.

    ``quantize(clamp(dequantize(quantize(x))))`` with full-range q/dq becomes ``quantize(clamp(x))``, and
    ``clamp(relu(y))`` with a lower bound of at least 0 becomes ``clamp(y)``, where ``x`` / ``y`` is a conv's
    output: the same integers (the bounds are grid points, so clamping before or after rounding agrees; ReLU
    is a clamp at 0), but the conv then matches inductor's ``dq -> conv -> hardtanh -> q`` fusion, one oneDNN
    int8 conv with a uint8 output, where the chain left a separate kernel (after a ReLU, on a float32
    output) per conv: resnet18 FX at batch 32, 2 threads, 2.79x float -> 3.38x. Pools, reshapes and linears
    keep the chain (inductor fuses them with the full-range quantize after them, not with a clamp; linear has
    no hardtanh fusion). A ReLU6 (any hardtanh or ReLU) that torch.ao left on the conv's quantized output, on the
    same grid, goes into the conv's clamp too (:func:`_fold_clamping_activations`). For inductor only:
    onnxruntime fuses a conv into ``QLinearConv`` only when it feeds the quantize directly.
    Returns how many chains and activations changed.

    Args:
        gm: the q/dq graph after :func:`explicit_activation_clamps`, changed in place (recompiled if anything changed).
    """
    qd = quantized_decomposed_ops()
    changed = 0
    for clamp in list(gm.graph.nodes):
        if clamp.op != "call_function" or clamp.target is not torch.ops.aten.clamp.default or len(clamp.args) != 3:
            continue
        dq, lo, hi = clamp.args
        if not (isinstance(dq, torch.fx.Node) and dq.target is qd.dequantize_per_tensor.default and len(dq.users) == 1):
            continue
        q = dq.args[0]
        if not (isinstance(q, torch.fx.Node) and q.target is qd.quantize_per_tensor.default and len(q.users) == 1):
            continue
        if tuple(q.args[1:6]) != tuple(dq.args[1:6]) or not all(
                u.target is qd.quantize_per_tensor.default for u in clamp.users):
            continue
        x = q.args[0]
        if (isinstance(x, torch.fx.Node) and x.target in (torch.ops.aten.relu.default, torch.ops.aten.relu_.default)
                and len(x.users) == 1 and isinstance(lo, (int, float)) and lo >= 0):
            x = x.args[0]
        if not (isinstance(x, torch.fx.Node) and x.target in _CONVOLUTIONS):
            continue  # a pool, reshape or linear fuses with the quantize after it as the chain stands
        clamp.args = (x, lo, hi)
        changed += 1
    changed += _fold_clamping_activations(gm)
    changed += _narrow_quantizes_after_float_ops(gm)
    changed += _drop_identity_requantizes(gm)
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


# ReLU6 and other clamping activations that torch.ao does not fuse into the conv: (min, max) from a node's arguments.
# In place too: torchvision's MobileNetV2 has ReLU6(inplace=True), and the exported graph keeps hardtanh_.
_CLAMPING_ACTIVATIONS: dict[Any, Callable[[tuple[Any, ...]], tuple[Any, Any]]] = {
    torch.ops.aten.hardtanh.default: lambda args: (args[1] if len(args) > 1 else -1.0, args[2] if len(args) > 2 else 1.0),
    torch.ops.aten.hardtanh_.default: lambda args: (args[1] if len(args) > 1 else -1.0, args[2] if len(args) > 2 else 1.0),
    torch.ops.aten.relu.default: lambda args: (0.0, math.inf),
    torch.ops.aten.relu_.default: lambda args: (0.0, math.inf),
}


def _only_user(node: Any, target: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.target is target and len(node.users) == 1


def _grid(node: torch.fx.Node) -> tuple[Any, ...]:
    """A per-tensor q/dq node's scale, zero point and dtype (a dequantize's range arguments change nothing)."""
    return node.args[1], node.args[2], node.args[5]


def _fold_clamping_activations(gm: torch.fx.GraphModule) -> int:
    """``clamp(conv) -> q -> dq -> hardtanh(a, b) -> q`` on one grid -> ``clamp(conv, max(lo, a), min(hi, b)) -> q``.

    torch.ao FX does not fuse ReLU6 into a conv: the int8 model quantizes the conv's output, clamps it on the
    same grid and quantizes again, and inductor compiled the middle into a separate uint8 kernel per conv
    (34 on mobilenet_v2). One clamp gives the same integers: the conv's bounds are grid points, and a bound
    ``b`` between grid points rounds to ``round(b / s)`` either way (a value that rounds above ``b`` rounds to
    that same point). Only where every quantize and dequantize of the chain has one user and the same
    scale, zero point and range, and the bounds overlap. Returns how many activations were folded.
    """
    qd = quantized_decomposed_ops()
    q_op, dq_op = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
    changed = 0
    for act in list(gm.graph.nodes):
        if act.op != "call_function" or act.target not in _CLAMPING_ACTIVATIONS or act.kwargs:
            continue
        a, b = _CLAMPING_ACTIVATIONS[act.target](act.args)
        dq = act.args[0]
        if not _only_user(dq, dq_op) or not _only_user(dq.args[0], q_op):
            continue
        q = dq.args[0]
        q_args = tuple(q.args[1:6])  # scale, zero point, range, dtype
        clamp = q.args[0]
        if (_grid(dq) != _grid(q) or not _only_user(clamp, torch.ops.aten.clamp.default)
                or len(clamp.args) != 3 or not (isinstance(clamp.args[0], torch.fx.Node) and clamp.args[0].target in _CONVOLUTIONS)):
            continue
        lo, hi = [clamp.args[1], float(a)], [clamp.args[2], float(b)]
        # after the activation: its quantize on the grid, or explicit_activation_clamps' chain back onto it
        end = next(iter(act.users)) if len(act.users) == 1 else None
        if not (isinstance(end, torch.fx.Node) and end.target is q_op and tuple(end.args[1:6]) == q_args):
            continue
        if len(end.users) == 1 and _only_user(next(iter(end.users)), dq_op):
            dq2 = next(iter(end.users))
            clamp2 = next(iter(dq2.users))
            tail = next(iter(clamp2.users)) if clamp2.target is torch.ops.aten.clamp.default and len(clamp2.users) == 1 else None
            if _grid(dq2) == _grid(q) and len(clamp2.args) == 3 and isinstance(tail, torch.fx.Node) and (
                    tail.target is q_op and tuple(tail.args[1:6]) == q_args):
                lo.append(clamp2.args[1])
                hi.append(clamp2.args[2])
                end = tail
        if not all(isinstance(v, (int, float)) for v in (*lo, *hi)) or max(lo) > min(hi):
            continue
        clamp.args = (clamp.args[0], max(lo), min(hi))
        end.replace_all_uses_with(q)
        # erased here: dead-code elimination keeps an in-place activation (a mutating op counts as impure)
        node = end
        while node is not q and not node.users:
            before = node.args[0]
            gm.graph.erase_node(node)
            node = before
        changed += 1
    return changed


# Float ops that inductor compiles into the elementwise kernel of the quantize after them (never an int8 kernel of
# its own that could take the quantize over): their clamp chains become one narrow-range quantize. Not add / mul:
# the same integers, but resnet50 FX's inductor module, narrowed after its 16 residual adds, read 19 ms where the
# chain read 11.8 inside lowering=auto's timing (in a script of its own it read faster; not understood)
_FLOAT_PRODUCERS = {torch.ops.aten.gelu.default, torch.ops.aten.layer_norm.default, torch.ops.aten.permute.default}


def _requantized_float_op(x: torch.fx.Node) -> bool:
    """Whether ``x`` is ``dq(q(y))`` of a float op ``y`` of :data:`_FLOAT_PRODUCERS`, or an eval-mode dropout of one:
    a quantize of ``x`` onto another grid is a requantize inductor compiles into ``y``'s own kernel (a GELU's output
    onto the grid the dropout after it trained, timm's Mlp), never into an int8 kernel."""
    qd = quantized_decomposed_ops()
    if x.target is torch.ops.aten.dropout.default and len(x.args) == 3 and x.args[2] is False:
        x = x.args[0]
    q = x.args[0] if isinstance(x, torch.fx.Node) and x.target is qd.dequantize_per_tensor.default and x.args else None
    y = q.args[0] if isinstance(q, torch.fx.Node) and q.target is qd.quantize_per_tensor.default else None
    return isinstance(y, torch.fx.Node) and y.target in _FLOAT_PRODUCERS


def _narrow_quantizes_after_float_ops(gm: torch.fx.GraphModule) -> int:
    """``q(x) -> dq -> clamp(lo, hi) -> q`` after a float op ``x`` (GELU, LayerNorm) -> ``q(x, range lo..hi)``; also
    where ``x`` requantizes such an op's codes onto another grid (:func:`_requantized_float_op`).

    The same integers (the clamp bounds are grid points: :func:`explicit_activation_clamps` made the chain from that
    quantize). inductor compiled the chain into the op's kernel as two more float -> uint8 -> float round trips, and
    the kernels of timm convnext_atto FX read 5x slower than PT2E's (notes/perf.md section 17). Only after the
    float ops listed: a quantize that inductor fuses into an int8 kernel or a reshape (conv, linear, pool, cat,
    views) kept the chain, and narrowing those changed the integers (convnext_atto: 5 dB from the fake-quant model).
    Returns how many chains changed.
    """
    qd = quantized_decomposed_ops()
    q_op, dq_op = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
    changed = 0
    for clamp in list(gm.graph.nodes):
        if clamp.op != "call_function" or clamp.target is not torch.ops.aten.clamp.default or len(clamp.args) != 3:
            continue
        dq, lo, hi = clamp.args
        if not (_only_user(dq, dq_op) and _only_user(dq.args[0], q_op)) or not all(isinstance(v, float) for v in (lo, hi)):
            continue
        q = dq.args[0]
        x, scale, zero_point = q.args[0], q.args[1], q.args[2]
        tail = next(iter(clamp.users)) if len(clamp.users) == 1 else None
        if not (isinstance(x, torch.fx.Node) and (x.target in _FLOAT_PRODUCERS or _requantized_float_op(x))
                and isinstance(tail, torch.fx.Node)
                and tail.target is q_op and tuple(tail.args[1:6]) == tuple(q.args[1:6]) and _grid(dq) == _grid(q)):
            continue
        qmin, qmax = zero_point + round(lo / scale), zero_point + round(hi / scale)
        if not q.args[3] <= qmin < qmax <= q.args[4]:
            continue
        tail.args = (x, scale, zero_point, qmin, qmax, q.args[5], *tail.args[6:])
        changed += 1
    return changed


# Ops that only move or select elements: grid points in, the same grid points out (torch.ao FX observes each
# one's output on its input's grid, so the q/dq graph requantizes after every one)
_DATA_MOVEMENT = {
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.contiguous.default,
    torch.ops.aten.clone.default, torch.ops.aten.flatten.using_ints, torch.ops.aten.chunk.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, operator.getitem,
}


def _moves_codes(node: torch.fx.Node) -> bool:
    """Whether each value ``node`` outputs is one of its first input's values, in the same dtype: data movement, or
    a max pool (it selects; max commutes with a dequantize, whose scale is positive). A max pool of a window over 25
    elements is not: inductor hands those to aten, whose channels-last max pool keeps window indices in an integer
    of the element's size and refuses 8-bit inputs of over 127 elements per image ("Expected input_depth *
    input_height * input_width <= ...", ``cpu_max_pool_channels_last``; pytorch/executorch#21820 met it too);
    smaller ones it compiles to a kernel of its own on the codes (shufflenet_v2's stem: 19 us, against 168 us of
    ``quantized::max_pool2d``, the kernel torchao's x86 passes make of dq -> max_pool2d -> q)."""
    if node.target in _DATA_MOVEMENT:
        return True
    if node.target is not torch.ops.aten.max_pool2d.default or len(node.args) < 2:
        return False
    window = list(node.args[1]) if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    window = window * 2 if len(window) == 1 else window  # one size: a square window
    return all(isinstance(k, int) for k in window) and math.prod(window) <= 25


def _requantize_free_users() -> set[Any]:
    """Users that may read a tensor in place of its identity dequantize (a function: the q/dq ops register lazily)."""
    qd = quantized_decomposed_ops()
    return {*_DATA_MOVEMENT, torch.ops.aten.max_pool2d.default, torch.ops.aten.clamp.default,
            qd.quantize_per_tensor.default}


def _codes_of_quantize(q: torch.fx.Node, codes: dict[torch.fx.Node, tuple[Any, ...]]) -> tuple[int, int]:
    """The integer codes a ``quantize_per_tensor`` node can output: its range, narrowed by a float clamp before
    it (computed by the op itself on the clamp's float32 bounds, so exactly as the graph rounds them) or by its
    input's own codes on the same grid."""
    qd = quantized_decomposed_ops()
    scale, zero_point, qmin, qmax, dtype = q.args[1:6]
    x = q.args[0]
    if x in codes and codes[x][:3] == (scale, zero_point, dtype):
        return max(qmin, codes[x][3]), min(qmax, codes[x][4])
    if (isinstance(x, torch.fx.Node) and x.target is torch.ops.aten.clamp.default and len(x.args) == 3
            and all(isinstance(v, (int, float)) for v in x.args[1:])):
        bounds = qd.quantize_per_tensor.default(torch.tensor(x.args[1:], dtype=torch.float32), *q.args[1:6])
        return int(bounds[0]), int(bounds[1])
    return qmin, qmax


def _leaves_under(node: Any, leaf: Any) -> Optional[list[torch.fx.Node]]:
    """The ``leaf``-op nodes that ``node`` is, directly or through data movement and concatenation; ``None`` when
    anything else is on the way."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.target is leaf:
        return [node]
    if _moves_codes(node):
        return _leaves_under(node.args[0], leaf)
    if node.target is torch.ops.aten.cat.default and isinstance(node.args[0], (list, tuple)) and node.args[0]:
        found = [_leaves_under(i, leaf) for i in node.args[0]]
        return None if any(f is None for f in found) else [n for f in found for n in f]  # type: ignore[union-attr]
    return None


def _quantizes_under(node: Any) -> Optional[list[torch.fx.Node]]:
    """The quantizes whose codes ``node`` is, directly or moved and concatenated; ``None`` when it is anything else."""
    return _leaves_under(node, quantized_decomposed_ops().quantize_per_tensor.default)


def _dequantized_codes(node: Any) -> bool:
    """Whether ``node`` is dequantizes of codes (quantizes', moved or not), moved and concatenated: a tensor
    :func:`_codes_of` can rebuild on the codes."""
    dequantizes = _leaves_under(node, quantized_decomposed_ops().dequantize_per_tensor.default)
    return dequantizes is not None and all(_quantizes_under(dq.args[0]) is not None for dq in dequantizes)


def _codes_of(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """The codes a :func:`_dequantized_codes` tensor was dequantized from, moved and concatenated alike (new nodes,
    inserted where the graph's insertion point is)."""
    if node.target is quantized_decomposed_ops().dequantize_per_tensor.default:
        return node.args[0]
    if node.target is torch.ops.aten.cat.default:
        inputs = [_codes_of(graph, i) for i in node.args[0]]
        return graph.call_function(node.target, (inputs, *node.args[1:]), dict(node.kwargs))
    return graph.call_function(node.target, (_codes_of(graph, node.args[0]), *node.args[1:]), dict(node.kwargs))


def _drop_identity_requantizes(gm: torch.fx.GraphModule) -> int:
    """Quantize -> dequantize pairs and clamps that give back their input exactly, removed.

    torch.ao FX requantizes after every view, transpose, chunk or concatenation on the same grid, with x86's clamp
    chain after each (``dq -> view -> q -> dq -> clamp -> q -> dq``): shufflenet_v2's channel shuffles are five of
    them in a row, and inductor compiled them into float32 buffers and extra kernels (its fused kernels took 1.0 ms
    a call under FX against 0.47 ms under PT2E). A tensor whose values are the dequantized codes ``a..b`` of a grid
    (a dequantize of a quantize whose codes are known, or a data-movement op or max pool of one,
    :func:`_moves_codes`) comes back unchanged from a
    quantize onto that grid whose range holds ``a..b`` and the dequantize after it, and from a clamp whose bounds
    hold ``a``'s and ``b``'s values; and a quantize right after the dequantize of such codes, onto their grid, gives
    back the codes themselves, so its users (a conv's dequantize too) read those. Each is checked on every code by
    running the ops. A requantize onto another grid, or one whose range cuts the codes, stays. Returns how many
    pairs, quantizes and clamps were removed.
    """
    qd = quantized_decomposed_ops()
    q_op, dq_op = qd.quantize_per_tensor.default, qd.dequantize_per_tensor.default
    requantize_free = _requantize_free_users()
    codes: dict[torch.fx.Node, tuple[Any, ...]] = {}  # node -> (scale, zero point, dtype, lowest code, highest code)
    changed = 0

    def values(grid: tuple[Any, ...]) -> torch.Tensor:
        scale, zero_point, dtype, a, b = grid
        return dq_op(torch.arange(a, b + 1, dtype=torch.int32).to(dtype), scale, zero_point, a, b, dtype)

    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.kwargs:
            continue
        x = node.args[0] if node.args else None
        if node.target is torch.ops.aten.cat.default and isinstance(x, (list, tuple)) and x and all(
                isinstance(i, torch.fx.Node) and i in codes for i in x):
            grids = {codes[i][:3] for i in x}
            if len(grids) == 1:
                codes[node] = (*grids.pop(), min(codes[i][3] for i in x), max(codes[i][4] for i in x))
            continue
        if not isinstance(x, torch.fx.Node):
            continue
        if node.target is dq_op and (roots := _quantizes_under(x)) is not None:
            # a dequantize of codes, or of codes moved or concatenated (as a requantize below may have left them)
            if any(q.kwargs or not all(isinstance(v, (int, float)) for v in q.args[1:5]) or _grid(q) != _grid(node)
                   for q in roots):
                continue
            root, t = roots[0], x.args[0]
            ranges = [_codes_of_quantize(q, codes) for q in roots]
            a, b = min(r[0] for r in ranges), max(r[1] for r in ranges)
            scale, zero_point, dtype = root.args[1], root.args[2], root.args[5]
            # a cheap filter first; the ops run on every code below decide
            if (root is x and t in codes and codes[t][:3] == (scale, zero_point, dtype)
                    and codes[t][3] >= a and codes[t][4] <= b):
                grid = codes[t]
                v = values(grid)
                if torch.equal(dq_op(q_op(v, *x.args[1:6]), *node.args[1:6]), v):  # the pair gives back its input
                    # not for a conv, linear or pool: inductor makes int8 kernels of what reads a dequantize
                    # (shufflenet_v2 ran a float conv when this took every user)
                    moved = node.replace_all_uses_with(t, delete_user_cb=lambda user: user.target in requantize_free)
                    changed += len(moved)
                    if len(node.users):
                        codes[node] = grid
                    continue
            if a <= b:
                codes[node] = (scale, zero_point, dtype, a, b)
        elif node.target is q_op and x in codes and _dequantized_codes(x):
            # q(dq(c)) onto c's own grid (through views, transposes, chunks, concatenations): its users read c
            # (moved alike on the codes), so a conv reads a dequantize of c. After a GELU, convnext_atto FX
            # requantized this way before each next conv: one more float -> uint8 round trip in the GELU's kernel
            # (453 -> 351 us at its first stage, compiled alone)
            scale, zero_point, dtype, a, b = codes[x]
            if (isinstance(node.args[1], (int, float)) and _grid(node) == (scale, zero_point, dtype)
                    and node.args[3] <= a and b <= node.args[4]
                    and torch.equal(q_op(values(codes[x]), *node.args[1:6]), torch.arange(a, b + 1).to(dtype))):
                with gm.graph.inserting_before(node):
                    node.replace_all_uses_with(_codes_of(gm.graph, x))
                changed += 1
        elif node.target is torch.ops.aten.clamp.default and x in codes and len(node.args) == 3:
            lo, hi = node.args[1:]
            v = values(codes[x])
            if all(isinstance(c, (int, float)) for c in (lo, hi)) and torch.equal(torch.clamp(v, lo, hi), v):
                changed += len(node.replace_all_uses_with(x, delete_user_cb=lambda user: user.target in requantize_free))
                if len(node.users):
                    codes[node] = codes[x]
        elif x in codes and _moves_codes(node):
            codes[node] = codes[x]
    return changed


# ops whose dequantized input inductor's x86 passes match into an int8 kernel (oneDNN conv / linear, max pool on the
# codes): they keep reading the codes
_CODE_READERS = (*_CONVOLUTIONS, torch.ops.aten.linear.default, torch.ops.aten.max_pool2d.default,
                 torch.ops.aten.max_pool2d_with_indices.default)


def uint8_loads_are_slow() -> bool:
    """Whether inductor's CPU kernels load uint8 the slow way on this CPU (AVX2 and below; see :func:`float_round_trips`)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")


def float_round_trips(gm: torch.fx.GraphModule) -> int:
    """A ``quantize -> dequantize`` whose value feeds float ops -> the same rounding done in float32; returns how
    many changed.

    ``dequantize(quantize(x))`` becomes ``(clamp(round(x * (1 / s)) + zp, qmin, qmax) - zp) * s`` (:func:`_fake_quantize`,
    what :func:`to_aten` writes too): the formula of ``quantized_decomposed``'s two ops, so the same numbers (bit for
    bit, eagerly), but the codes are never stored.
    Data movement between the two (a permute, a reshape) is applied to the float value instead.
    Why: inductor's CPU kernels step through uint8 eight values at a time (one AVX2 float vector), and on AVX2
    ``Vectorized<uint8_t>::loadu(ptr, 8)`` copies them through a 32-byte buffer (``vec256_int.h``; AVX-512 has a
    fast path for its 16). A ``dequantize -> GELU -> quantize`` kernel over 327,680 values took 931 us from uint8
    and 340 us from float32, ``dequantize -> mul -> quantize`` 522 us against 145 us (torch 2.14.1, 2 threads, an
    AMD EPYC with AVX2). The producer (a oneDNN conv, usually) then writes float32 and the consumer's kernel
    rounds: convnext_atto FX under inductor at batch 32, 17.6 -> 10.9 ms, the same outputs.
    Consumers that inductor runs on the codes (:data:`_CODE_READERS`: int8 convs and linears, max pools) keep
    the dequantize. For inductor on CPUs where :func:`uint8_loads_are_slow` only.

    Args:
        gm: the q/dq graph, changed in place (recompiled if anything changed).
    """
    qd = quantized_decomposed_ops()
    changed = 0
    for dq in list(gm.graph.nodes):
        if dq.op != "call_function" or dq.target is not qd.dequantize_per_tensor.default:
            continue
        shapes, q = [], dq.args[0]
        while isinstance(q, torch.fx.Node) and q.target in _DATA_MOVEMENT:  # a round trip commutes with them
            shapes.append(q)
            q = q.args[0]
        if not (isinstance(q, torch.fx.Node) and q.target is qd.quantize_per_tensor.default):
            continue
        x, scale, zero_point, qmin, qmax = q.args[:5]
        # a narrow quantize is read back by a full-range dequantize: the grid (scale, zero point) is what must agree
        if (not isinstance(x, torch.fx.Node) or not isinstance(scale, float) or not isinstance(zero_point, int)
                or tuple(dq.args[1:3]) != (scale, zero_point) or dq.kwargs.get("out_dtype") not in (None, torch.float32)):
            continue
        floats = [u for u in dq.users if u.target not in _CODE_READERS]
        if not floats:
            continue
        with gm.graph.inserting_before(dq):
            value = gm.graph.call_function(_fake_quantize, (x, scale, zero_point, qmin, qmax))
            for shape in reversed(shapes):
                value = gm.graph.call_function(shape.target, (value, *shape.args[1:]), dict(shape.kwargs))
        for user in floats:
            user.replace_input_with(dq, value)
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return changed


def scalar_qparams(gm: torch.fx.GraphModule) -> int:
    """Per-tensor q/dq with constant scale/zero point -> the ``.default`` overload with Python scalars.

    The ONNX exporter translates only that overload (with ``.tensor`` it fails: "int() argument must
    be ... not 'SymbolicTensor'"); per-tensor weights (qnnpack's default qconfig) produce ``.tensor``.
    Returns how many nodes changed.

    Args:
        gm: the q/dq graph, changed in place; only nodes whose scale and zero point are one-element
            constants (``get_attr``) are rewritten.
    """
    qd = quantized_decomposed_ops()
    targets = {qd.quantize_per_tensor.tensor: qd.quantize_per_tensor.default,
               qd.dequantize_per_tensor.tensor: qd.dequantize_per_tensor.default}
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in targets or len(node.args) < 3:
            continue
        scale, zero_point = node.args[1], node.args[2]
        if not all(isinstance(a, torch.fx.Node) and a.op == "get_attr" for a in (scale, zero_point)):
            continue
        s_val, z_val = _fetch_attr(gm, scale.target), _fetch_attr(gm, zero_point.target)
        if s_val.numel() != 1 or z_val.numel() != 1:
            continue
        node.target = targets[node.target]
        node.args = (node.args[0], float(s_val.item()), int(z_val.item()), *node.args[3:])
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
        _remove_unused_attrs(gm)
    return changed


def qdq_program(module: nn.Module, example: Inputs, dynamic_batch: bool = True) -> QdqProgram:
    """``torch.export`` a q/dq module, fold the weight quantization into int8 constants, export again.

    Args:
        module: the q/dq module to export.
        example: example inputs of one call (keywords bound to positions).
        dynamic_batch: export dim 0 of the inputs as a symbolic batch (see :func:`export_args`).
    """
    args, dynamic = export_args(positional_args(module, example), dynamic_batch)
    with quiet_export():
        first = torch.export.export(module, args, dynamic_shapes=dynamic)
        gm = first.module()
        ops = _op_sets()
        fold_constants(gm, keep=lambda n: n.target in ops["dq_tensor"] | ops["dq_channel"])
        scalar_qparams(gm)
        explicit_activation_clamps(gm)
        program = torch.export.export(gm, args, dynamic_shapes=dynamic)
        with torch.no_grad():
            outputs = flat_tensors(program.module()(*args))
    names = input_names(module, len(args))
    out_names = ["output"] if len(outputs) == 1 else [f"output_{i}" for i in range(len(outputs))]
    return QdqProgram(program, args, dynamic, names, out_names)


def aten_program(qdq: QdqProgram) -> Any:
    """The q/dq program rewritten to core ATen ops (see :func:`to_aten`) and exported again.

    Args:
        qdq: the q/dq program (its ``program`` is not changed; a new module is taken from it).
    """
    with quiet_export():
        gm = qdq.program.module()
        to_aten(gm)
        return torch.export.export(gm, qdq.args, dynamic_shapes=qdq.dynamic_shapes)


def qparams_summary(program: Any) -> dict[str, Any]:
    """Scales / zero points of every q/dq node of a q/dq program, labelled with the module producing the input.

    Args:
        program: a ``torch.export.ExportedProgram`` with quantized_decomposed q/dq ops.

    Returns:
        ``{"activations": [...], "weights": [...]}``: per activation quantize its scale, zero point, range
        and dtype (``"dynamic"`` when computed per call); per constant weight dequantize its layer, shape,
        dtype, per-channel axis and scale range.
    """
    ops = _op_sets()
    gm = program.graph_module
    consts = {**dict(program.named_parameters()), **dict(program.named_buffers()), **program.constants}
    placeholders = {spec.arg.name: spec.target for spec in program.graph_signature.input_specs if spec.target}

    def value(arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            target = placeholders.get(arg.name) or (arg.target if arg.op == "get_attr" else None)
            if target in consts:
                return consts[target]
            if arg.op == "get_attr":
                return _fetch_attr(gm, arg.target)
        return arg

    def label(node: torch.fx.Node) -> str:
        if node.op == "placeholder" and node.name not in placeholders:
            return f"input {node.name}"
        stack = node.meta.get("nn_module_stack") or {}
        if stack:
            return list(stack.values())[-1][0] or node.name
        return node.name

    def narrowed(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int, int]]:
        """For the last quantize of an :func:`explicit_activation_clamps` chain (quantize, dequantize, clamp,
        quantize): the first quantize and the narrow range the clamp keeps."""
        clamp = node.args[0]
        if not (isinstance(clamp, torch.fx.Node) and clamp.target is torch.ops.aten.clamp.default):
            return None
        dq = clamp.args[0]
        if not (isinstance(dq, torch.fx.Node) and dq.target in ops["dq_tensor"] and isinstance(dq.args[0], torch.fx.Node)
                and dq.args[0].target in ops["q_tensor"]):
            return None
        first = dq.args[0]
        scale, zp = value(node.args[1]), value(node.args[2])
        lo, hi = clamp.args[1:3]
        if not all(isinstance(v, (int, float)) for v in (scale, zp, lo, hi)):
            return None
        # only the chain itself: one tensor on one grid, nothing else reading its first half
        same = all(value(n.args[i]) == v for n in (first, dq) for i, v in ((1, scale), (2, zp)))
        if not same or len(first.users) != 1 or len(dq.users) != 1 or len(clamp.users) != 1:
            return None
        return first, round(lo / scale) + int(zp), round(hi / scale) + int(zp)

    chains = {n: narrowed(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in ops["q_tensor"]}
    widened = {chain[0] for chain in chains.values() if chain}
    activations, weights = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in widened:
            continue
        if node.target in ops["q_tensor"]:
            scale, zp, qmin, qmax, dtype = (value(a) for a in node.args[1:6])
            if chains[node]:  # one activation: the producer's name, the range it trained to
                first, qmin, qmax = chains[node]
                node = first
            if isinstance(scale, torch.fx.Node) or isinstance(zp, torch.fx.Node):
                # dynamic quantization (e.g. a dynamic int8 LSTM): choose_qparams computes them per call
                activations.append({"after": label(node.args[0]), "scale": "dynamic", "zero_point": "dynamic",
                                    "dtype": str(dtype).replace("torch.", "")})
                continue
            activations.append(
                {
                    "after": label(node.args[0]),
                    "scale": float(scale),
                    "zero_point": int(zp),
                    "quant_min": int(qmin),
                    "quant_max": int(qmax),
                    "dtype": str(dtype).replace("torch.", ""),
                }
            )
        elif node.target in ops["dq_channel"] | ops["dq_tensor"]:
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and (source.op == "get_attr" or source.name in placeholders):
                w = value(source)
                scale = torch.as_tensor(value(node.args[1])).float()
                users = [u for u in node.users]
                weights.append(
                    {
                        "layer": label(users[0]) if users else node.name,
                        "shape": list(w.shape) if isinstance(w, torch.Tensor) else None,
                        "dtype": str(getattr(w, "dtype", "")).replace("torch.", ""),
                        "per_channel_axis": int(value(node.args[3])) if node.target in ops["dq_channel"] else None,
                        "scale_min": float(scale.min()),
                        "scale_max": float(scale.max()),
                    }
                )
    return {"activations": activations, "weights": weights}


# Per-node debugging metadata torch.export records (source lines, module paths, node provenance):
# more than half of a small program's serialized graph, and nothing a loaded program needs to run.
DEBUG_META = ("stack_trace", "from_node", "nn_module_stack", "source_fn_stack", "torch_fn", "original_aten", "seq_nr")


def write_pt2(program: Any, path: Path, keep_debug_meta: bool = False) -> None:
    """``torch.export.save`` of ``program``; without :data:`DEBUG_META` unless ``keep_debug_meta``.

    The program itself is left as it was (its metadata is restored after writing).

    Args:
        program: the ``torch.export.ExportedProgram`` to save.
        path: the ``.pt2`` file to write.
        keep_debug_meta: keep the per-node debugging metadata in the file.
    """
    saved: list[tuple[dict[str, Any], str, Any]] = []
    if not keep_debug_meta:
        for module in program.graph_module.modules():
            if isinstance(module, torch.fx.GraphModule):
                for node in module.graph.nodes:
                    for key in DEBUG_META:
                        if key in node.meta:
                            saved.append((node.meta, key, node.meta.pop(key)))
    try:
        with quiet_export():
            torch.export.save(program, str(path))
    finally:
        for meta, key, value in saved:
            meta[key] = value


def write_onnx(qdq: QdqProgram, path: Path, opset: Optional[int] = None) -> int:
    """QDQ ONNX of the q/dq program (dynamo exporter); returns the opset written.

    int8 weight initializers are rewritten as uint8 (:func:`unsigned_weight_initializers`).

    Args:
        qdq: the q/dq program, with its input and output names.
        path: the ``.onnx`` file to write (no external data).
        opset: the ONNX opset version; ``None`` for the exporter's default.
    """
    kwargs: dict[str, Any] = {}
    if opset is not None:
        kwargs["opset_version"] = opset
    with quiet_export():
        torch.onnx.export(
            qdq.program,
            (),
            str(path),
            dynamo=True,
            external_data=False,
            input_names=qdq.input_names,
            output_names=qdq.output_names,
            verbose=False,
            optimize=True,
            **kwargs,
        )
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    if unsigned_weight_initializers(model):
        onnx.save(model, str(path))
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


def unsigned_weight_initializers(model: Any) -> int:
    """Store int8 weight initializers of ``DequantizeLinear`` as uint8 (value + 128, zero point + 128).

    The dequantized weights are exactly the same. Why: onnxruntime runs QDQ convolutions and matmuls
    with int8 weights through u8s8 kernels, which on x86 CPUs without VNNI (AVX2, e.g. this project's
    AMD EPYC machines) sum pairs of u8 x s8 products into int16 with saturation (``vpmaddubsw``):
    with full-range activations and full-range int8 weights (qnnpack's qconfig, 4-bit-free W8) the
    ONNX model departed from the int8 model by 11.3 dB SQNR (78.5 % top-1 agreement). uint8 weights
    take onnxruntime's u8u8 kernels, which widen before multiplying and never saturate. Returns how
    many initializers changed.

    Args:
        model: the ``onnx.ModelProto``, changed in place.
    """
    from onnx import numpy_helper

    initializers = {init.name: init for init in model.graph.initializer}
    pairs = [(n.input[0], n.input[2]) for n in model.graph.node
             if n.op_type == "DequantizeLinear" and len(n.input) >= 3 and n.input[0] in initializers and n.input[2] in initializers]
    names = {name for pair in pairs for name in pair}
    # only where every tensor involved is int8 (a shared zero point moves with all its weights)
    if any(numpy_helper.to_array(initializers[name]).dtype.name != "int8" for name in names):
        names = {name for w, zp in pairs for name in (w, zp)
                 if all(numpy_helper.to_array(initializers[x]).dtype.name == "int8" for x in (w, zp))}
    for name in names:
        init = initializers[name]
        value = numpy_helper.to_array(init)
        init.CopyFrom(numpy_helper.from_array((value.astype("int16") + 128).astype("uint8"), name))
    return len(names)
