"""Config of exports and the parity gate (issue 7): ``export.*`` and ``parity.*`` of ``qlightning train``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional


class ExportFormat(str, Enum):
    """An artifact of each quantized submodule, written next to the report."""

    torchscript = "torchscript"  # int8_<module>.pt: the lowered int8 model, torch.jit.load
    onnx = "onnx"  # int8_<module>.onnx: QDQ form (QuantizeLinear/DequantizeLinear), onnxruntime
    pt2 = "pt2"  # int8_<module>.pt2: torch.export program, torch.export.load


class Pt2Ops(str, Enum):
    """Operator set of the ``.pt2`` program."""

    aten = "aten"  # core ATen only (round/clamp q-dq arithmetic, int8 weights): loads after `import torch`
    quantized_decomposed = "quantized_decomposed"  # PT2E q/dq ops; load after `import torch.ao.quantization`


class OnBreach(str, Enum):
    """What a parity breach does: ``fail`` or ``warn``."""

    fail = "fail"  # raise ParityError (the run fails; report.json is still written)
    warn = "warn"  # warn and record the breach in the report


ONNX_PACKAGES = ("onnx", "onnxruntime", "onnxscript")  # the `export` extra of qlightning


def default_formats() -> List[ExportFormat]:
    """All three formats; ONNX only where its packages are installed (``pip install 'qlightning[export]'``)."""
    formats = [ExportFormat.torchscript, ExportFormat.onnx, ExportFormat.pt2]
    if not all(importlib.util.find_spec(p) is not None for p in ONNX_PACKAGES):
        formats.remove(ExportFormat.onnx)
    return formats


@dataclass
class ExportConf:
    """Which artifacts to write when fit ends (and with ``qlightning export CHECKPOINT``).

    Each artifact ``int8_<module>.<ext>`` gets a sidecar manifest ``int8_<module>.<ext>.json``
    (input/output names, shapes, dtypes, backend, qparams summary, provenance).
    """

    formats: List[ExportFormat] = field(default_factory=default_formats, metadata={"help": "artifacts per quantized module: torchscript (int8_NAME.pt), onnx (QDQ), pt2 (torch.export); default all three (onnx only with the export extra)"})
    dynamic_batch: bool = field(default=True, metadata={"help": "dim 0 of every input is symbolic in the ONNX and .pt2 artifacts"})
    onnx_opset: Optional[int] = field(default=None, metadata={"help": "ONNX opset; null = the torch.onnx (dynamo) exporter default"})
    pt2_ops: Pt2Ops = field(default=Pt2Ops.aten, metadata={"help": "aten: core ATen q/dq arithmetic (loads after import torch); quantized_decomposed: PT2E q/dq ops"})


@dataclass
class ParityConf:
    """The gate comparing fp32, fake-quant, int8 and each exported artifact on held-out batches.

    Gated: int8 against its reference (the same quantized graph simulated in float: catches a broken
    conversion or lowering) and each artifact against int8. fp32 vs fake-quant vs int8 are reported.
    """

    enabled: bool = field(default=True, metadata={"help": "run the fake-vs-real parity gate after fit"})
    batches: int = field(default=8, metadata={"help": "first N batches of the test loader compared"})
    min_sqnr_db: float = field(default=30.0, metadata={"help": "SQNR (dB) int8 must reach against its float-simulated reference, and each artifact against int8"})
    min_top1_agreement: float = field(default=0.99, metadata={"help": "top-1 agreement required for outputs with a class dimension"})
    on_breach: OnBreach = field(default=OnBreach.fail, metadata={"help": "fail (raise after writing report.json) or warn"})
    layer_batches: int = field(default=2, metadata={"help": "batches for the per-layer SQNR and activation ranges of the report"})


def check_export_config(cfg: object) -> List[str]:
    """What the types of ``export.*`` / ``parity.*`` cannot express, one message per problem (empty: fine).

    Meant for :func:`qlightning.config.validate.validate_config` and ``qlightning train`` before fit.

    Args:
        cfg: the config (anything with ``export`` and ``parity`` mappings as attributes; missing ones are empty).
    """
    problems: List[str] = []
    export = getattr(cfg, "export", None) or {}
    parity = getattr(cfg, "parity", None) or {}
    formats = [str(getattr(f, "value", f)) for f in (export.get("formats") or [])]
    if len(set(formats)) != len(formats):
        problems.append(f"export.formats={formats}: a format is listed twice")
    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    if "onnx" in formats and missing:
        problems.append(f"export.formats: 'onnx' needs {missing}; pip install 'qlightning[export]' or drop 'onnx'")
    opset = export.get("onnx_opset")
    if opset is not None and int(opset) < 18:
        problems.append(f"export.onnx_opset={opset}: the torch.onnx dynamo exporter writes opset 18 or newer; use null or >= 18")
    for key in ("batches", "layer_batches"):
        value = parity.get(key)
        if value is not None and int(value) < 1:
            problems.append(f"parity.{key}={value}: must be at least 1")
    top1 = parity.get("min_top1_agreement")
    if top1 is not None and not 0.0 <= float(top1) <= 1.0:
        problems.append(f"parity.min_top1_agreement={top1}: a share, between 0 and 1")
    return problems
