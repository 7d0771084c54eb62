"""Config of exports and the parity gate (issue 7): ``export.*`` and ``parity.*`` of ``qlightning train``."""

from __future__ import annotations

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

    aten = "aten"  # core ATen only (fake_quantize_per_tensor_affine, int8 weights): loads after `import torch`
    quantized_decomposed = "quantized_decomposed"  # PT2E q/dq ops; load after `import torch.ao.quantization`


class OnBreach(str, Enum):
    fail = "fail"  # raise ParityError (the run fails; report.json is still written)
    warn = "warn"  # warn and record the breach in the report


@dataclass
class ExportConf:
    """Which artifacts to write when fit ends (and with ``qlightning export CHECKPOINT``).

    Each artifact ``int8_<module>.<ext>`` gets a sidecar manifest ``int8_<module>.<ext>.json``
    (input/output names, shapes, dtypes, backend, qparams summary, provenance).
    """

    formats: List[ExportFormat] = field(
        default_factory=lambda: [ExportFormat.torchscript, ExportFormat.onnx, ExportFormat.pt2]
    )
    dynamic_batch: bool = True  # dim 0 of every input is symbolic in the ONNX and .pt2 artifacts
    onnx_opset: Optional[int] = None  # null: the torch.onnx (dynamo) exporter's default (18 or newer)
    pt2_ops: Pt2Ops = Pt2Ops.aten


@dataclass
class ParityConf:
    """The gate comparing fp32, fake-quant, int8 and each exported artifact on held-out batches.

    Gated: int8 against its reference (the same quantized graph simulated in float: catches a broken
    conversion or lowering) and each artifact against int8. fp32 vs fake-quant vs int8 are reported.
    """

    enabled: bool = True
    batches: int = 8  # first N batches of the datamodule's test loader
    min_sqnr_db: float = 30.0
    min_top1_agreement: float = 0.99  # for outputs with a class dimension (last dim > 1)
    on_breach: OnBreach = OnBreach.fail
    layer_batches: int = 2  # batches used for the per-layer SQNR and activation ranges of the report
