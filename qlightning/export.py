"""Exports of a converted int8 submodule: TorchScript, ONNX (QDQ form) and ``torch.export`` (``.pt2``).

What works on torch 2.13 (and why each route was chosen):

* **TorchScript** (``int8_<m>.pt``): the lowered int8 GraphModule itself (``quantized::conv2d`` with
  packed params), scripted or traced. Runs the same fbgemm/x86/qnnpack kernels as the int8 model.
* **``.pt2``**: ``torch.export`` cannot capture the lowered int8 model (its packed-params script
  objects have no ``__obj_flatten__``), nor the reference model of ``convert_to_reference_fx``
  (quantized tensors, ``aten.dequantize.self`` unsupported). It *can* capture the decomposed reference
  model (``_convert_to_reference_decomposed_fx``: ``quantized_decomposed.quantize/dequantize_*`` ops on
  plain uint8/int8 tensors, float conv/linear), with a dynamic batch dimension. Two fixes make it
  reproduce the int8 model: activations quantize over the full range of their dtype (the x86 qconfig's
  ``reduce_range`` observer range [0, 127] only sets the scale; the int8 kernels fill 0..255), and the
  weight quantization is folded into int8 constants. The ``quantized_decomposed`` ops are registered
  only by ``torch.ao.quantization``, so by default (``export.pt2_ops=aten``) they are rewritten to core
  ATen (round/clamp arithmetic for activations, int8 weights dequantized by ``(w - zp) * scale``): the file
  loads with ``torch.export.load`` after a plain ``import torch``.
* **ONNX**: the TorchScript exporter (``dynamo=False``) fails on the fake-quant model
  (``aten::fused_moving_avg_obs_fake_quant`` has no symbolic) and on the reference model (qscheme
  attributes); the dynamo exporter (``torch.onnx.export(exported_program, dynamo=True)``) turns the
  decomposed q/dq program into ``QuantizeLinear``/``DequantizeLinear`` pairs with int8 weight
  initializers (QDQ form), dynamic batch, one self-contained file, which onnxruntime runs.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import io
import json
import logging
import os
import platform
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from qlightning.engines.base import Inputs
from qlightning.errors import QLightningError

FORMATS = ("torchscript", "onnx", "pt2")
EXTENSIONS = {"torchscript": ".pt", "onnx": ".onnx", "pt2": ".pt2"}
MANIFEST_VERSION = 1


class ExportError(QLightningError, RuntimeError):
    """An artifact could not be written; the message names the module, the format and the cause."""


@dataclass
class Artifact:
    """One written (or failed) artifact of one quantized submodule."""

    module: str
    format: str
    path: Optional[Path] = None
    manifest: Optional[Path] = None
    size_bytes: Optional[int] = None
    export_s: Optional[float] = None
    error: Optional[str] = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.format}"

    def to_dict(self, root: Optional[Path] = None) -> dict[str, Any]:
        def rel(p: Optional[Path]) -> Optional[str]:
            if p is None:
                return None
            try:
                return str(p.relative_to(root)) if root is not None else str(p)
            except ValueError:
                return str(p)

        return {
            "module": self.module,
            "format": self.format,
            "path": rel(self.path),
            "manifest": rel(self.manifest),
            "size_bytes": self.size_bytes,
            "export_s": self.export_s,
            "error": self.error,
            **self.info,
        }


def artifact_path(directory: Path, module: str, fmt: str) -> Path:
    """``<dir>/int8_<module><ext>`` (the TorchScript name is the one ``qlightning train`` always wrote)."""
    return Path(directory) / f"int8_{module}{EXTENSIONS[fmt]}"


# ---------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence what torch.export / torch.onnx print on every call (progress lines, torchvision notes)."""
    names = ("torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export", "torch._export", "onnxscript", "onnx_ir")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def positional_args(module: nn.Module, inputs: Inputs) -> tuple[Any, ...]:
    """Keyword inputs bound to their positions (exported programs and ONNX take positional inputs).

    Bound against the engine's module behind a lowering wrapper (whose ``forward(*args, **kwargs)``
    would swallow the keywords into one dict).
    """
    if not inputs.kwargs:
        return tuple(inputs.args)
    from qlightning.lowering import source_of

    signature = inspect.signature(source_of(module).forward)
    bound = signature.bind_partial(*inputs.args, **inputs.kwargs)
    variadic = [p.name for p in signature.parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(name in bound.arguments for name in variadic):
        raise TypeError(
            f"cannot bind keyword inputs {sorted(inputs.kwargs)} to positions: {type(source_of(module)).__name__}.forward"
            f"{signature} takes them as *args/**kwargs"
        )
    return tuple(bound.arguments.values())


def input_names(module: nn.Module, count: int) -> list[str]:
    """Names of the first ``count`` parameters of ``module.forward`` (``x`` for the digits CNN)."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = params[:count]
    return names + [f"input_{i}" for i in range(len(names), count)]


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) output, in pytree order; quantized tensors are dequantized."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return [t.dequantize() if t.is_quantized else t for t in leaves if isinstance(t, torch.Tensor)]


def export_args(args: Sequence[Any], dynamic_batch: bool) -> tuple[tuple[Any, ...], Optional[tuple[Any, ...]]]:
    """Example args for ``torch.export`` and ``dynamic_shapes`` marking dim 0 (the batch) as symbolic.

    Tensors whose dim 0 has the batch size of the first tensor share one ``Dim``. A batch of 1 is
    repeated to 2 (export specializes sizes 0 and 1).
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


# ---------------------------------------------------------------------------------------------- q/dq graph


def _qd_ops() -> Any:
    import torch.ao.quantization.fx._decomposed  # noqa: F401  registers torch.ops.quantized_decomposed

    return torch.ops.quantized_decomposed


def _overloads(packet: Any) -> set[Any]:
    return {getattr(packet, name) for name in packet.overloads()}


def _op_sets() -> dict[str, set[Any]]:
    qd = _qd_ops()
    return {
        "q_tensor": _overloads(qd.quantize_per_tensor),
        "dq_tensor": _overloads(qd.dequantize_per_tensor),
        "q_channel": _overloads(qd.quantize_per_channel),
        "dq_channel": _overloads(qd.dequantize_per_channel),
    }


def full_range_activations(gm: torch.fx.GraphModule) -> int:
    """Give every per-tensor quantize/dequantize the full range of its dtype; returns how many changed.

    The lowered FX int8 model stores activations as quint8/qint8 tensors over the whole dtype range;
    ``reduce_range`` (x86/fbgemm qconfigs observe over [0, 127]) only shrinks the scale. The decomposed
    reference graph keeps the observer's range and would clip where the int8 model does not.
    """
    ops = _op_sets()
    changed = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops["q_tensor"] | ops["dq_tensor"] and len(node.args) >= 6:
            dtype = node.args[5]
            if isinstance(dtype, torch.dtype) and not dtype.is_floating_point:
                info = torch.iinfo(dtype)
                if (node.args[3], node.args[4]) != (info.min, info.max):
                    node.args = (*node.args[:3], info.min, info.max, *node.args[5:])
                    changed += 1
    gm.recompile()
    return changed


def qdq_module(callback: Any, pl_module: nn.Module, name: str) -> nn.Module:
    """The converted submodule ``name`` as a float graph of q/dq ops that reproduces the int8 model.

    FX engine: the decomposed reference model of the kept fake-quant copy (activation ranges and
    qparams as :meth:`~qlightning.engines.fx.FxEngine.convert` gives the int8 model).
    PT2E engine: the converted module, which already is a q/dq graph.
    """
    engine = callback.engine
    if engine.name != "fx":
        from qlightning.lowering import source_of

        return copy.deepcopy(source_of(pl_module.get_submodule(name))).eval()
    fake_quant = getattr(callback, "fake_quant_modules", {}).get(name)
    if fake_quant is None:
        raise ExportError(
            f"{name}: ONNX and .pt2 exports are built from the fake-quant copy of the module, which was not kept; "
            "construct QuantizationAwareTraining with keep_fake_quant=True (the default)"
        )
    from torch.ao.quantization.quantize_fx import _convert_to_reference_decomposed_fx

    from qlightning.engines.fx import quiet_torch_ao

    spec = callback.spec
    module = copy.deepcopy(fake_quant).eval()
    engine.set_observers(module, False)
    from qlightning.engines.fx import trained_qparams

    # the same qparams and activation ranges as FxEngine.convert: the trained scales, and activations
    # clamped to the fake-quant's range unless engine_options clamp_activations=false (then int8 fills
    # its dtype's whole range and so must the reference)
    with quiet_torch_ao(), trained_qparams(module, spec.options.get("trained_qparams", True)):
        reference = _convert_to_reference_decomposed_fx(
            module,
            convert_custom_config=spec.convert_custom_config,
            backend_config=engine.backend_config(spec),
        )
    if not spec.options.get("clamp_activations", True):
        full_range_activations(reference)
    return reference.eval()


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
    """A narrower-than-dtype per-tensor quantize (x86 ``reduce_range``: 0..127) -> a float clamp to that
    range, then a quantize over the dtype's full range; returns how many changed.

    The same numbers (the clamp bounds are integer multiples of the scale), but ONNX ``QuantizeLinear``
    has no quant_min/quant_max: the exporter drops them and onnxruntime clamps to 0..255 (measured: onnx
    vs int8 13.5 dB on digits once int8 clamps to the trained range). An explicit clamp (ONNX ``Clip``)
    survives every route.
    """
    qd = _qd_ops()
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
        with gm.graph.inserting_before(node):
            clamp = gm.graph.call_function(torch.ops.aten.clamp.default, (x, (qmin - zero_point) * scale, (qmax - zero_point) * scale))
        node.args = (clamp, scale, zero_point, info.min, info.max, dtype, *node.args[6:])
        changed += 1
    if changed:
        gm.recompile()
    return changed


def scalar_qparams(gm: torch.fx.GraphModule) -> int:
    """Per-tensor q/dq with constant scale/zero point -> the ``.default`` overload with Python scalars.

    The ONNX exporter translates only that overload (with ``.tensor`` it fails: "int() argument must
    be ... not 'SymbolicTensor'"); per-tensor weights (qnnpack's default qconfig) produce ``.tensor``.
    Returns how many nodes changed.
    """
    qd = _qd_ops()
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
    """``torch.export`` a q/dq module, fold the weight quantization into int8 constants, export again."""
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
    """The q/dq program rewritten to core ATen ops (see :func:`to_aten`) and exported again."""
    with quiet_export():
        gm = qdq.program.module()
        to_aten(gm)
        return torch.export.export(gm, qdq.args, dynamic_shapes=qdq.dynamic_shapes)


def qparams_summary(program: Any) -> dict[str, Any]:
    """Scales / zero points of every q/dq node of a q/dq program, labelled with the module producing the input."""
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

    activations, weights = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in ops["q_tensor"]:
            scale, zp, qmin, qmax, dtype = (value(a) for a in node.args[1:6])
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


# ---------------------------------------------------------------------------------------------- writers


def write_torchscript(int8: nn.Module, example: Inputs, path: Path) -> None:
    from qlightning.app import save_int8

    problem = save_int8(int8, path, example)
    if problem is not None:
        raise ExportError(problem)


# Per-node debugging metadata torch.export records (source lines, module paths, node provenance):
# more than half of a small program's serialized graph, and nothing a loaded program needs to run.
DEBUG_META = ("stack_trace", "from_node", "nn_module_stack", "source_fn_stack", "torch_fn", "original_aten", "seq_nr")


def write_pt2(program: Any, path: Path, keep_debug_meta: bool = False) -> None:
    """``torch.export.save`` of ``program``; without :data:`DEBUG_META` unless ``keep_debug_meta``.

    The program itself is left as it was (its metadata is restored after writing).
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
    """QDQ ONNX of the q/dq program (dynamo exporter); returns the opset written."""
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
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), -1)


# ---------------------------------------------------------------------------------------------- loaders


class OnnxRunner:
    """Callable wrapper of an onnxruntime session: tensors in, tensors out (one tensor when one output)."""

    def __init__(self, path: Path, threads: Optional[int] = None) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = int(threads or torch.get_num_threads())
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *args: Any) -> Any:
        feed = {n: a.detach().cpu().numpy() for n, a in zip(self.names, args)}
        outs = [torch.from_numpy(o) for o in self.session.run(None, feed)]
        return outs[0] if len(outs) == 1 else tuple(outs)


def load_artifact(path: Path, fmt: str, threads: Optional[int] = None) -> Callable[..., Any]:
    """Load an artifact as a callable the way a user would (no qlightning objects involved)."""
    if fmt == "torchscript":
        return torch.jit.load(str(path)).eval()
    if fmt == "pt2":
        with quiet_export():
            return torch.export.load(str(path)).module()
    if fmt == "onnx":
        return OnnxRunner(path, threads)
    raise ValueError(f"unknown export format {fmt!r}; valid: {list(FORMATS)}")


# ---------------------------------------------------------------------------------------------- manifests


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("lightning", "onnx", "onnxruntime", "onnxscript", "torchao", "qlightning"):
        try:
            from importlib.metadata import version

            versions[pkg] = version(pkg)
        except Exception:
            pass
    return versions


def _tensor_spec(t: Any, dynamic: bool) -> dict[str, Any]:
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    shape: list[Any] = list(t.shape)
    if dynamic and shape:
        shape[0] = "batch"
    return {"shape": shape, "dtype": str(t.dtype).replace("torch.", "")}


def manifest(
    artifact: Artifact,
    *,
    int8: nn.Module,
    example: Inputs,
    backend: str,
    engine: str,
    dynamic_batch: bool,
    qparams: dict[str, Any],
    provenance: dict[str, Any],
) -> dict[str, Any]:
    """The sidecar JSON of one artifact: how to load it, its inputs/outputs, backend, qparams, provenance."""
    args = positional_args(int8, example)
    with torch.no_grad():
        outputs = flat_tensors(int8(*args))
    dynamic = dynamic_batch  # TorchScript too: scripted or traced, the int8 ops take any batch (tested)
    names = input_names(int8, len(args))
    out_names = ["output"] if len(outputs) == 1 else [f"output_{i}" for i in range(len(outputs))]
    load = {
        "torchscript": "torch.jit.load(path)",
        "pt2": "torch.export.load(path).module()"
        + ("" if artifact.info.get("pt2_ops", "aten") == "aten" else "  # after: import torch.ao.quantization"),
        "onnx": "onnxruntime.InferenceSession(path)",
    }[artifact.format]
    runtime = {
        "torchscript": f"torch.jit, quantized kernels for {backend} (torch.backends.quantized.engine = '{backend}')"
        if engine == "fx" else "torch.jit of the q/dq graph (float ops with int8 q/dq simulation)",
        "pt2": "torch.export ExportedProgram, float ops with int8 q/dq simulation",
        "onnx": "onnxruntime, QDQ (QuantizeLinear/DequantizeLinear) form",
    }[artifact.format]
    config = provenance.get("config") or {}
    return {
        "manifest_version": MANIFEST_VERSION,
        "module": artifact.module,
        "format": artifact.format,
        "file": artifact.path.name if artifact.path else None,
        "size_bytes": artifact.size_bytes,
        "load": load,
        "runtime": runtime,
        "backend": backend,
        "engine": engine,
        "inputs": [{"name": n, **_tensor_spec(a, dynamic)} for n, a in zip(names, args)],
        "outputs": [{"name": n, **_tensor_spec(o, dynamic)} for n, o in zip(out_names, outputs)],
        "dynamic_batch": dynamic,
        "qparams": qparams,
        "details": artifact.info,
        "provenance": {
            "recipe": provenance.get("recipe"),  # name, origin, path, sha256 (qlightning train)
            "quant": config.get("quant"),
            "trained_with": provenance.get("versions"),
            "exported_with": _versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }


def write_manifest(path: Path, data: dict[str, Any]) -> Path:
    target = Path(str(path) + ".json")
    target.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    return target


# ---------------------------------------------------------------------------------------------- driver


def export_module(
    callback: Any,
    pl_module: nn.Module,
    name: str,
    example: Inputs,
    directory: Path,
    formats: Sequence[str],
    *,
    dynamic_batch: bool = True,
    onnx_opset: Optional[int] = None,
    pt2_ops: str = "aten",
    existing: Optional[dict[str, Path]] = None,
) -> tuple[list[Artifact], Optional[nn.Module]]:
    """Write every requested artifact of the converted submodule ``name``; failures are recorded, not raised.

    Returns the artifacts and the q/dq reference module (``None`` when it could not be built).
    ``existing`` maps formats to files already written (``qlightning train`` writes the TorchScript one).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from qlightning.lowering import source_of

    int8 = source_of(pl_module.get_submodule(name))  # TorchScript holds the engine's module, whatever runs now
    provenance = dict(getattr(callback, "provenance", {}) or {})
    artifacts: list[Artifact] = []
    reference: Optional[nn.Module] = None
    qdq: Optional[QdqProgram] = None
    qdq_error: Optional[str] = None
    qdq_s = 0.0
    if any(f in ("onnx", "pt2") for f in formats):
        start = time.perf_counter()
        try:
            reference = qdq_module(callback, pl_module, name)
            qdq = qdq_program(reference, example, dynamic_batch)
        except Exception as exc:
            qdq_error = f"q/dq program: {type(exc).__name__}: {str(exc)[:1500]}"
        qdq_s = time.perf_counter() - start
    qparams = qparams_summary(qdq.program) if qdq is not None else {}
    for fmt in formats:
        art = Artifact(module=name, format=fmt, path=artifact_path(directory, name, fmt))
        start = time.perf_counter()
        try:
            if fmt == "torchscript":
                given = (existing or {}).get(fmt)
                if given is not None and Path(given).is_file():
                    art.path = Path(given)
                else:
                    write_torchscript(int8, example, art.path)
            elif qdq is None:
                raise ExportError(qdq_error or "no q/dq program")
            elif fmt == "pt2":
                program = qdq.program if pt2_ops == "quantized_decomposed" else aten_program(qdq)
                write_pt2(program, art.path)
                art.info["pt2_ops"] = pt2_ops
            elif fmt == "onnx":
                missing = [p for p in ("onnx", "onnxruntime", "onnxscript") if importlib.util.find_spec(p) is None]
                if missing:
                    raise ExportError(f"ONNX export needs {missing}: pip install 'qlightning[export]'")
                art.info["opset"] = write_onnx(qdq, art.path, onnx_opset)
            else:
                raise ExportError(f"unknown format {fmt!r}; valid: {list(FORMATS)}")
            art.size_bytes = art.path.stat().st_size
        except Exception as exc:
            art.error = f"{type(exc).__name__}: {str(exc)[:1500]}"
            art.path = None
        art.export_s = round(time.perf_counter() - start + (qdq_s if fmt != "torchscript" else 0.0), 3)
        if art.error is None:
            data = manifest(
                art,
                int8=int8,
                example=example,
                backend=getattr(callback, "backend", "?"),
                engine=callback.engine.name,
                dynamic_batch=dynamic_batch,
                qparams=qparams,
                provenance=provenance,
            )
            art.manifest = write_manifest(art.path, data)  # type: ignore[arg-type]
        artifacts.append(art)
    return artifacts, reference


def file_size(path: Optional[Path]) -> Optional[int]:
    return os.path.getsize(path) if path is not None and os.path.exists(path) else None
