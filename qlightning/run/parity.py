"""The parity gate: fp32, fake-quant, int8 and every exported artifact compared on held-out batches.

Two measures, each between a candidate and a reference on the same inputs:

* SQNR in dB, ``10 log10(sum(ref^2) / sum((ref - candidate)^2))`` over every output element;
* top-1 agreement, the share of samples whose argmax over the last dimension agrees (outputs with a
  class dimension only).

Gated (thresholds ``parity.min_sqnr_db`` / ``parity.min_top1_agreement``): the int8 model against its
reference, the same quantized graph simulated in float (a broken conversion, lowering or scale shows
here), and each artifact against the int8 model. Reported only: fake-quant and int8 against the same
weights in float (what quantization costs), the trained float weights against the float snapshot at
fake-quant start (training drift) and int8 against fake-quant.

Per layer, the same SQNR is measured on the output of every module of the quantized graph
(``torch.fx.Interpreter`` records each node; a layer's value is taken after the quantize/dequantize or
fake-quant steps that follow it), which names the worst layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from qlightning.core.inputs import Inputs, first_tensor, flat_tensors, input_hooks
from qlightning.core.metrics import MAX_SQNR_DB, ratio_db, sqnr_db, summed_sqnr_db, top1_agreement  # noqa: F401  re-exported
from qlightning.core.fidelity import _is_quant_module, layer_nodes, per_layer_sqnr, record, worst_layers  # noqa: F401  re-exported
from qlightning.errors import QLightningError
from qlightning.run.report import quiet_lightning

class ParityError(QLightningError, RuntimeError):
    """An int8 model or an exported artifact does not reproduce what it should (see ``parity.*``)."""


# ---------------------------------------------------------------------------------------------- inputs


def capture_heldout(
    pl_module: nn.Module,
    datamodule: Any,
    targets: Sequence[str],
    batches: int,
    trainer_factory: Callable[[int], Any],
) -> dict[str, list[Inputs]]:
    """Inputs of each quantized submodule on the first ``batches`` test batches.

    Runs ``trainer.test`` (so the LightningModule's own ``test_step`` feeds the submodules) with a
    forward pre-hook on each target; returns an empty list for a target whose inputs were not seen.

    Args:
        pl_module: the LightningModule.
        datamodule: the data whose test loader feeds it.
        targets: names of the quantized submodules.
        batches: how many test batches.
        trainer_factory: makes a Trainer limited to that many test batches.
    """
    captured: dict[str, list[Inputs]] = {name: [] for name in targets}

    def grab(name: str, inputs: Inputs) -> None:
        captured[name].append(Inputs(tuple(_copy(a) for a in inputs.args), {k: _copy(v) for k, v in inputs.kwargs.items()}))

    with input_hooks({name: pl_module.get_submodule(name) for name in targets}, grab), quiet_lightning():
        trainer_factory(batches).test(pl_module, datamodule=datamodule, verbose=False)
    return captured


def _copy(value: Any) -> Any:
    """A tensor input detached and copied (the next batch may reuse its storage); anything else as is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


# ---------------------------------------------------------------------------------------------- outputs


def run_batches(fn: Callable[..., Any], batches: Sequence[tuple[Any, ...]]) -> list[torch.Tensor]:
    """Every output tensor of ``fn`` on each batch of positional args, flattened per batch and concatenated.

    Args:
        fn: the module (or callable) to run.
        batches: its positional inputs, one tuple per call.
    """
    per_output: list[list[torch.Tensor]] = []
    with torch.inference_mode():
        for args in batches:
            outs = flat_tensors(fn(*args))
            if not per_output:
                per_output = [[] for _ in outs]
            for i, o in enumerate(outs[: len(per_output)]):
                per_output[i].append(o.detach().float().cpu())
    return [torch.cat(parts) if parts[0].dim() > 0 else torch.stack(parts) for parts in per_output]


@dataclass
class Check:
    """One candidate against one reference on the held-out inputs of one quantized submodule."""

    module: str
    candidate: str
    reference: str
    sqnr_db: Optional[float]
    top1_agreement: Optional[float]
    gated: bool
    passed: bool = True
    samples: int = 0
    error: Optional[str] = None

    def breach(self, min_sqnr_db: float, min_top1: float) -> list[str]:
        """What this check breaches, in words (empty when it passes).

        Args:
            min_sqnr_db: the SQNR a candidate needs against its reference.
            min_top1: the top-1 agreement it needs.
        """
        problems = []
        if self.error:
            problems.append(self.error)
        if self.sqnr_db is not None and self.sqnr_db < min_sqnr_db:
            problems.append(f"SQNR {self.sqnr_db:.1f} dB < {min_sqnr_db:g} dB (parity.min_sqnr_db)")
        if self.top1_agreement is not None and self.top1_agreement < min_top1:
            problems.append(f"top-1 agreement {self.top1_agreement:.3f} < {min_top1:g} (parity.min_top1_agreement)")
        return problems

    def to_dict(self) -> dict[str, Any]:
        """Plain data for report.json (SQNR and agreement rounded)."""
        d = asdict(self)
        d["sqnr_db"] = None if self.sqnr_db is None else round(self.sqnr_db, 3)
        d["top1_agreement"] = None if self.top1_agreement is None else round(self.top1_agreement, 5)
        return d


def compare(
    module: str,
    outputs: dict[str, Optional[list[torch.Tensor]]],
    pairs: Iterable[tuple[str, str, bool]],
    errors: Optional[dict[str, str]] = None,
) -> list[Check]:
    """A :class:`Check` per ``(candidate, reference, gated)`` pair; a missing candidate is a failed check.

    Args:
        module: the quantized submodule's name.
        outputs: each candidate's and reference's outputs (``None``: it could not run).
        pairs: ``(candidate, reference, gated)``.
        errors: why a candidate has no outputs, by candidate.
    """
    checks = []
    errors = errors or {}
    for candidate, reference, gated in pairs:
        cand, ref = outputs.get(candidate), outputs.get(reference)
        if cand is None or ref is None:
            missing = candidate if cand is None else reference
            checks.append(
                Check(module, candidate, reference, None, None, gated, False, 0,
                      error=f"{missing} could not be run: {errors.get(missing, 'not available')}")
            )
            continue
        top1 = top1_agreement(ref[0], cand[0]) if ref and cand else None
        samples = int(ref[0].shape[0]) if ref and ref[0].dim() > 0 else 1
        checks.append(Check(module, candidate, reference, summed_sqnr_db(zip(ref, cand)), top1, gated, True, samples))
    return checks


def gate(checks: Sequence[Check], min_sqnr_db: float, min_top1: float) -> list[tuple[Check, list[str]]]:
    """The gated checks that breach a threshold (marking them failed), with what each breaches.

    Args:
        checks: the checks of :func:`compare`.
        min_sqnr_db: the SQNR a gated candidate needs.
        min_top1: the top-1 agreement it needs.
    """
    breaches = []
    for check in checks:
        if not check.gated:
            continue
        problems = check.breach(min_sqnr_db, min_top1)
        check.passed = not problems
        if problems:
            breaches.append((check, problems))
    return breaches


def breach_message(
    breaches: Sequence[tuple[Check, list[str]]],
    min_sqnr_db: float,
    min_top1: float,
    layers: Sequence[dict[str, Any]],
    source: str,
) -> str:
    """One message naming every breaching artifact and the worst layers.

    Args:
        breaches: what :func:`gate` returned.
        min_sqnr_db: the SQNR threshold.
        min_top1: the top-1 agreement threshold.
        layers: per-layer SQNR rows of the int8 model, worst first named.
        source: what the inputs were, in words.
    """
    lines = [
        f"parity gate: {len(breaches)} breach(es) (SQNR >= {min_sqnr_db:g} dB, top-1 agreement >= {min_top1:g}; "
        f"inputs: {source})"
    ]
    for check, problems in breaches:
        lines.append(f"  - {check.module}: {check.candidate} vs {check.reference}: " + "; ".join(problems))
    first = next((row for row in layers if (row.get("conversion_sqnr_db") or MAX_SQNR_DB) < min_sqnr_db), None)
    if first is not None:
        lines.append(
            f"  first layer where int8 departs from its float-simulated reference (graph order): {first['layer']} "
            f"({first['conversion_sqnr_db']:.1f} dB)"
        )
    for column, title in (("conversion_sqnr_db", "int8 vs its float-simulated reference"),
                          ("int8_vs_float_sqnr_db", "int8 vs the same weights in float")):
        worst = worst_layers(layers, column, 5)
        value = {row["layer"]: row.get(column) for row in layers}
        if worst:
            lines.append(f"  worst layers ({title}): " + ", ".join(f"{n} {value[n]:.1f} dB" for n in worst))
    lines.append(
        "  (parity.on_breach=warn keeps the run going; thresholds: parity.min_sqnr_db, parity.min_top1_agreement)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- per layer


# ---------------------------------------------------------------------------------------------- ranges


def _fq_range(m: Any) -> tuple[float, int, int, int, float, float]:
    scale = float(m.scale.detach().float().reshape(-1)[0])
    zp = int(m.zero_point.detach().reshape(-1)[0])
    qmin, qmax = int(m.quant_min), int(m.quant_max)
    return scale, zp, qmin, qmax, scale * (qmin - zp), scale * (qmax - zp)


def activation_ranges(
    prefix: str, fake_quant: nn.Module, batches: Sequence[tuple[Any, ...]], float_model: Optional[nn.Module] = None
) -> list[dict[str, Any]]:
    """Per activation fake-quant of the QAT model (graph order): what it quantizes and how much it clips.

    For each activation fake-quant: scale, zero point, representable range and, on held-out data
    through the QAT model, the range of the values it quantizes and the share of them beyond its
    range (``clipped_fake_quant``) and beyond the int8 dtype range (``clipped_int8``). The values
    are taken *after* the op that feeds it, activation included: a fake-quant that applies a fused
    ReLU itself (the FX fast path) is run with quantization off on its input, so ReLU's negatives,
    which the activation removes anyway, do not count as clipped.

    Args:
        prefix: the quantized submodule's name (prefixes the layer names).
        fake_quant: the fake-quant GraphModule (observers off).
        batches: positional inputs of held-out batches.
        float_model: the same module with quantization off (:meth:`QuantSession.variants`'s
            ``trained_float``/``fp32``); its fake-quant modules give each value after the activation.
            Without it the fake-quant's input is counted as is.
    """
    if not isinstance(fake_quant, torch.fx.GraphModule):
        return []
    entries = []
    for node in fake_quant.graph.nodes:
        if node.op == "call_module" and _is_quant_module(fake_quant.get_submodule(node.target)):
            m = fake_quant.get_submodule(node.target)
            if not hasattr(m, "scale") or m.scale.numel() != 1:
                continue
            source = node.args[0] if node.args else None
            if not isinstance(source, torch.fx.Node):
                continue
            label = str(source.target) if source.op in ("call_module", "placeholder") else source.name
            if source.op == "placeholder":
                label = f"input {source.name}"
            entries.append((node, source, label, m))
    if not entries:
        return []
    passthrough: dict[str, Any] = {}  # the same fake-quant with quantization off: identity, or its fused ReLU
    for node, _, _, _ in entries:
        try:
            passthrough[node.name] = float_model.get_submodule(str(node.target)) if float_model is not None else None
        except AttributeError:
            passthrough[node.name] = None
    keep = {source.name for _, source, _, _ in entries}
    stats = {node.name: [math.inf, -math.inf, 0, 0, 0, False] for node, _, _, _ in entries}
    for args in batches:
        values = record(fake_quant, args, keep)
        for node, source, label, m in entries:
            v = values.get(source.name)
            if v is None:
                continue
            after = passthrough.get(node.name)
            if after is not None:
                with torch.inference_mode():
                    quantized_input = after(v)
                if not torch.equal(quantized_input, v):
                    stats[node.name][5] = True  # the fake-quant applies an activation (fused ReLU) first
                v = quantized_input
            scale, zp, qmin, qmax, low, high = _fq_range(m)
            dtype = getattr(m, "dtype", torch.quint8)
            info = torch.iinfo(torch.uint8 if dtype in (torch.quint8, torch.uint8) else torch.int8)
            s = stats[node.name]
            s[0], s[1] = min(s[0], float(v.min())), max(s[1], float(v.max()))
            s[2] += int(((v < low) | (v > high)).sum())
            s[3] += int(((v < scale * (info.min - zp)) | (v > scale * (info.max - zp))).sum())
            s[4] += v.numel()
    out = []
    for node, _, label, m in entries:
        scale, zp, qmin, qmax, low, high = _fq_range(m)
        s = stats[node.name]
        out.append(
            {
                "after": f"{prefix}.{label}" if prefix and not label.startswith("input ") else label,
                "observer": f"{prefix}.{node.target}" if prefix else str(node.target),
                "activation_applied": bool(s[5]),
                "scale": scale,
                "zero_point": zp,
                "quant_min": qmin,
                "quant_max": qmax,
                "range": [round(low, 6), round(high, 6)],
                "observed": [round(s[0], 6), round(s[1], 6)] if s[4] else None,
                "clipped_fake_quant": round(s[2] / s[4], 6) if s[4] else None,
                "clipped_int8": round(s[3] / s[4], 6) if s[4] else None,
            }
        )
    return out


def weight_ranges(prefix: str, int8: nn.Module) -> list[dict[str, Any]]:
    """Per quantized weight of the int8 model (module order): shape, dtype, scheme, float range, scale range.

    ``clipped`` is the share of weights at the ends of the integer range beyond the one per channel
    (per tensor) that a range fitted to the weights puts there: weights the range clipped (e.g. a
    moving-average observer that lagged while BatchNorm folding grew the weights).

    Args:
        prefix: the submodule's name, prepended to each weight's name.
        int8: the converted module.
    """
    out = []
    for name, m in int8.named_modules():
        weight = getattr(m, "weight", None)
        if not callable(weight) or isinstance(weight, torch.Tensor):
            continue
        try:
            w = weight()
        except Exception:
            continue
        if not isinstance(w, torch.Tensor) or not w.is_quantized:
            continue
        if w.qscheme() in (torch.per_channel_affine, torch.per_channel_symmetric):
            scales = w.q_per_channel_scales().float()
            axis: Optional[int] = int(w.q_per_channel_axis())
        else:
            scales, axis = torch.tensor([w.q_scale()]), None
        deq = w.dequantize()
        ints = w.int_repr()
        info = torch.iinfo(ints.dtype)
        at_ends = int(((ints == info.min) | (ints == info.max)).sum())
        # a range fitted to the weights puts about one value per channel at an end; the rest were clipped
        expected = int(scales.numel())
        out.append({
            "layer": f"{prefix}.{name}" if prefix else name,
            "shape": list(w.shape),
            "dtype": str(w.dtype).replace("torch.", ""),
            "qscheme": str(w.qscheme()).replace("torch.", ""),
            "axis": axis,
            "min": round(float(deq.min()), 6),
            "max": round(float(deq.max()), 6),
            "scale_min": float(scales.min()),
            "scale_max": float(scales.max()),
            "int_repr_min": int(w.int_repr().min()),
            "int_repr_max": int(w.int_repr().max()),
            "clipped": round(max(0, at_ends - expected) / max(1, ints.numel()), 6),
        })
    return out
