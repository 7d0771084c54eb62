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

import copy
import importlib.util
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from qlightning.core.inputs import Inputs, flat_tensors, positional_args, source_of
from qlightning.core.quiet import quiet
from qlightning.core.session import session_of
from qlightning.quantize.qdq import (
    ExportError,
    input_names,
    QdqProgram,
    aten_program,
    qdq_program,
    qparams_summary,
    quiet_export,
    to_aten,
    write_onnx,
    write_pt2,
)

FORMATS = ("torchscript", "onnx", "pt2")
EXTENSIONS = {"torchscript": ".pt", "onnx": ".onnx", "pt2": ".pt2"}
MANIFEST_VERSION = 1


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
        """``<module>:<format>``, the artifact's name in the report."""
        return f"{self.module}:{self.format}"

    def to_dict(self, root: Optional[Path] = None) -> dict[str, Any]:
        """Plain data for report.json.

        Args:
            root: paths are written relative to it when given.
        """

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
    """``<dir>/int8_<module><ext>`` (the TorchScript name is the one ``qlightning train`` always wrote).

    Args:
        directory: where artifacts are written.
        module: the quantized submodule's name.
        fmt: the format (``torchscript``, ``onnx``, ``pt2``).
    """
    return Path(directory) / f"int8_{module}{EXTENSIONS[fmt]}"


# ---------------------------------------------------------------------------------------------- helpers


# ---------------------------------------------------------------------------------------------- q/dq graph


# ---------------------------------------------------------------------------------------------- writers


def save_int8(module: torch.nn.Module, path: Path, inputs: Inputs) -> Optional[str]:
    """TorchScript of an int8 submodule, loadable with ``torch.jit.load`` without qlightning.

    Scripted when possible, else traced on the captured example inputs (FX-generated code
    carries annotations TorchScript cannot parse). Returns a problem description or ``None``.

    Args:
        module: the int8 submodule.
        path: the file to write.
        inputs: example inputs (tracing falls back to them when scripting fails).
    """
    module = _core_aten_qdq(module)
    # TorchScript's complaints about code it handles anyway: torch.ao's quantized modules annotate an
    # empty list in __init__; a PT2E graph's torch._check asserts trace as constants (the parity gate
    # runs the saved file against the int8 model, so a wrong trace is caught there, not here)
    with quiet(messages=_TORCHSCRIPT_NOISE):
        try:
            scripted = torch.jit.script(module)
        except Exception:
            try:
                with torch.no_grad():
                    scripted = torch.jit.trace(module, inputs.args, check_trace=False)
            except Exception as exc:  # say so in the report instead of failing the whole run
                return f"{type(exc).__name__}: {exc}"
    torch.jit.save(scripted, str(path))
    return None


_TORCHSCRIPT_NOISE = (
    r".*The TorchScript type system doesn't support instance-level annotations on empty non-base types",
    r".*Converting a tensor to a Python boolean might cause the trace to be incorrect",
)


def _core_aten_qdq(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a q/dq graph (PT2E's int8 model) with its ``quantized_decomposed`` q/dq ops rewritten to core ATen
    arithmetic (:func:`~qlightning.quantize.qdq.to_aten`, as the ``.pt2`` writer does); anything else as is.

    Why: those ops are registered by ``torch.ao.quantization.fx._decomposed``, which a plain ``import torch`` does not
    load, so ``torch.jit.load`` of a TorchScript file holding them fails in a fresh process ("Unknown builtin op:
    quantized_decomposed::dequantize_per_channel", measured on the digits job with ``quant.engine=pt2e``).
    """
    if not isinstance(module, torch.fx.GraphModule) or not any(
            "quantized_decomposed" in str(node.target) for node in module.graph.nodes if node.op == "call_function"):
        return module
    rewritten = copy.deepcopy(module)
    try:
        to_aten(rewritten)
    except ExportError:  # q/dq parameters computed per call (dynamic quantization): as before, torch.ao's ops stay
        return module
    return rewritten


def write_torchscript(int8: nn.Module, example: Inputs, path: Path) -> None:
    """TorchScript of ``int8`` at ``path`` (:func:`save_int8`); raises what it could not do.

    Args:
        int8: the int8 submodule.
        example: its example inputs.
        path: the file to write.
    """
    problem = save_int8(int8, path, example)
    if problem is not None:
        raise ExportError(problem)


# ---------------------------------------------------------------------------------------------- loaders


class OnnxRunner:
    """Callable wrapper of an onnxruntime session: tensors in, tensors out (one tensor when one output).

    Args:
        path: the ``.onnx`` file, run on the CPU provider.
        threads: onnxruntime intra-op threads; ``None`` uses ``torch.get_num_threads()``.
    """

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
    """Load an artifact as a callable the way a user would (no qlightning objects involved).

    Args:
        path: the artifact's file.
        fmt: its format.
        threads: onnxruntime's intra-op threads (``None``: torch's count).
    """
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
    qdq_graph: bool,
    dynamic_batch: bool,
    qparams: dict[str, Any],
    provenance: dict[str, Any],
    engine_notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The sidecar JSON of one artifact: how to load it, its inputs/outputs, backend, qparams, provenance.

    Args:
        artifact: the artifact written.
        int8: the engine's int8 module it was made from.
        example: its example inputs.
        backend: the int8 kernel library.
        engine: the engine's name, recorded.
        qdq_graph: whether the engine's int8 module is a float q/dq graph (the TorchScript file then is one too).
        dynamic_batch: whether dim 0 of the inputs is dynamic.
        qparams: scale / zero point summaries.
        provenance: what made the run.
        engine_notes: what the engine chose for the run (:meth:`QuantEngine.notes`), e.g. the CPUs whose int8
            kernels compute its activation range: a deployer reads them here.
    """
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
        if not qdq_graph else "torch.jit of the q/dq graph (float ops with int8 q/dq simulation)",
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
        "engine_notes": list(engine_notes),
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
    """Write ``data`` as the artifact's sidecar ``<path>.json``; returns its path.

    Args:
        path: the artifact's file.
        data: what :func:`manifest` returned.
    """
    target = Path(str(path) + ".json")
    target.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    return target


# ---------------------------------------------------------------------------------------------- driver


def export_module(
    session: Any,
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

    Args:
        session: the quantization session (or a callback holding one).
        pl_module: the LightningModule holding the converted submodule.
        name: the submodule's name.
        example: its example inputs.
        directory: where to write.
        formats: the formats to write.
        dynamic_batch: export dim 0 of the inputs as dynamic.
        onnx_opset: the ONNX opset (``None``: the exporter's default).
        pt2_ops: ``aten`` or ``quantized_decomposed`` ops in the ``.pt2`` program.
        existing: formats already written, to their files.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    session = session_of(session)
    int8 = source_of(pl_module.get_submodule(name))  # TorchScript holds the engine's module, whatever runs now
    provenance = dict(session.provenance)
    artifacts: list[Artifact] = []
    reference: Optional[nn.Module] = None
    qdq: Optional[QdqProgram] = None
    qdq_error: Optional[str] = None
    qdq_s = 0.0
    if any(f in ("onnx", "pt2") for f in formats):
        start = time.perf_counter()
        try:
            reference = session.reference_module(name)
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
                backend=session.backend,
                engine=session.engine.name,
                qdq_graph=session.engine.converts_to_qdq_graph,
                dynamic_batch=dynamic_batch,
                qparams=qparams,
                provenance=provenance,
                engine_notes=session.engine_notes,
            )
            art.manifest = write_manifest(art.path, data)  # type: ignore[arg-type]
        artifacts.append(art)
    return artifacts, reference


def file_size(path: Optional[Path]) -> Optional[int]:
    """The size of ``path`` in bytes, ``None`` when it does not exist.

    Args:
        path: a file, or ``None``.
    """
    return os.path.getsize(path) if path is not None and os.path.exists(path) else None
