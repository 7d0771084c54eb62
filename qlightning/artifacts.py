"""After fit: exports, the parity gate and the extended report (issue 7).

:func:`finalize_run` is called by :func:`qlightning.app.train` on rank zero once the int8 model and the
basic report exist; ``qlightning export CHECKPOINT`` runs the same :func:`export_and_check` on a model
restored from a checkpoint. Both write, next to the report:

* ``int8_<module>.pt`` / ``.onnx`` / ``.pt2`` (``export.formats``), each with a ``<file>.json`` manifest;
* report keys ``exports``, ``parity``, ``layers``, ``worst_layers``, ``ranges``, ``latency_detail``,
  ``size_on_disk``, ``plots``, and ``plots/*.png``.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from qlightning import export as exporting
from qlightning import parity as parity_mod
from qlightning.engines.base import Inputs
from qlightning.lowering import source_of
from qlightning.parity import ParityError

__all__ = ["finalize_run", "export_and_check", "markdown_sections", "ParityError"]


# ---------------------------------------------------------------------------------------------- config


def section(cfg: Any, key: str) -> Any:
    """``cfg.<key>`` merged over the schema defaults (works for a plain dict from a checkpoint too)."""
    from omegaconf import OmegaConf

    from qlightning.config.export_schema import ExportConf, ParityConf
    from qlightning.config.schema import ReportConf

    schema = {"export": ExportConf, "parity": ParityConf, "report": ReportConf}[key]
    node = None
    if cfg is not None:
        node = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
    base = OmegaConf.structured(schema)
    merged = OmegaConf.merge(base, node) if node is not None else base
    return OmegaConf.to_container(merged, resolve=True, enum_to_str=True)


def _eval_trainer_factory() -> Callable[[int], Any]:
    from qlightning.report import evaluation_trainer

    return evaluation_trainer


# ---------------------------------------------------------------------------------------------- helpers


def _slice(inputs: Inputs, rows: int) -> Inputs:
    def cut(v: Any) -> Any:
        return v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    return Inputs(tuple(cut(a) for a in inputs.args), {k: cut(v) for k, v in inputs.kwargs.items()})


def _latency(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int) -> float:
    from qlightning.report import median_latency_ms

    return round(median_latency_ms(fn, Inputs(args), repeats), 4)  # type: ignore[arg-type]


def _tile_args(args: tuple[Any, ...], batch: int) -> tuple[Any, ...]:
    from qlightning.report import _tile

    return tuple(_tile(list(args), batch))


def _write_report(report: dict[str, Any], run_dir: Path) -> None:
    from qlightning import report as reporting

    if "metrics" in report:
        reporting.write(report, run_dir)
        md = run_dir / "report.md"
        text = md.read_text()
        if SECTION_MARK not in text:
            md.write_text(text + markdown_sections(report))
    else:
        (run_dir / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str))


# ---------------------------------------------------------------------------------------------- main


def export_and_check(
    callback: Any,
    model: nn.Module,
    datamodule: Any,
    out_dir: Path,
    export_cfg: dict[str, Any],
    parity_cfg: dict[str, Any],
    report_cfg: dict[str, Any],
    *,
    existing: Optional[dict[str, dict[str, Path]]] = None,
    base_report: Optional[dict[str, Any]] = None,
    trainer_factory: Optional[Callable[[int], Any]] = None,
) -> dict[str, Any]:
    """Exports, parity checks, per-layer SQNR, ranges, sizes, latencies and plots; returns report keys.

    Raises :class:`ParityError` on a gated breach when ``parity.on_breach == "fail"``, after writing
    ``report.json`` (merged over ``base_report``) so the run directory explains the failure.
    """
    from qlightning.report import state_dict_bytes, variants

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = list(callback.targets)
    formats = [str(f) for f in export_cfg.get("formats") or []]
    threads = report_cfg.get("latency_threads") or torch.get_num_threads()
    try:
        versions = variants(callback, model)
    except (AttributeError, KeyError):  # a callback that keeps no fake-quant copy: int8 (and its exports) only
        versions = {
            "fp32": {n: None for n in targets},
            "fake_quant": {n: None for n in targets},
            "int8": {n: model.get_submodule(n) for n in targets},
        }
    versions.setdefault("fake_quant", {n: None for n in targets})  # PostTrainingQuantization keeps none
    factory = trainer_factory or _eval_trainer_factory()
    extra: dict[str, Any] = {}
    timings: dict[str, float] = {}

    # held-out inputs of every quantized submodule
    start = time.perf_counter()
    heldout: dict[str, list[Inputs]] = {name: [] for name in targets}
    source = f"first {parity_cfg['batches']} batch(es) of the test loader"
    if parity_cfg.get("enabled") or report_cfg.get("enabled"):
        try:
            heldout = parity_mod.capture_heldout(model, datamodule, targets, int(parity_cfg["batches"]), factory)
        except Exception as exc:  # no test loader / test_step: fall back to the captured example inputs
            source = f"example inputs (the test loader could not be used: {type(exc).__name__}: {exc})"
    for name in targets:
        if not heldout.get(name):
            heldout[name] = [callback.inputs[name]]
            source = "example inputs (the quantized modules saw no test batch)"
    timings["capture_s"] = time.perf_counter() - start

    # exports
    start = time.perf_counter()
    artifacts: dict[str, list[exporting.Artifact]] = {}
    references: dict[str, Optional[nn.Module]] = {}
    for name in targets:
        example = _slice(heldout[name][0], 2)
        artifacts[name], references[name] = exporting.export_module(
            callback,
            model,
            name,
            example,
            out_dir,
            formats,
            dynamic_batch=bool(export_cfg.get("dynamic_batch", True)),
            onnx_opset=export_cfg.get("onnx_opset"),
            pt2_ops=str(export_cfg.get("pt2_ops", "aten")),
            existing=(existing or {}).get(name),
        )
        if references[name] is None and not any(f in ("onnx", "pt2") for f in formats):
            try:  # the gate's int8 reference, even when no ONNX/.pt2 export was asked for
                references[name] = exporting.qdq_module(callback, model, name)
            except Exception:
                references[name] = None
    extra["exports"] = {name: {a.format: a.to_dict(out_dir) for a in arts} for name, arts in artifacts.items()}
    failed = [f"{a.key}: {a.error}" for arts in artifacts.values() for a in arts if a.error]
    for problem in failed:
        warnings.warn(f"qlightning export failed: {problem}", stacklevel=2)
    timings["export_s"] = time.perf_counter() - start

    # load every artifact the way a user would
    loaded: dict[str, dict[str, Callable[..., Any]]] = {}
    load_errors: dict[str, dict[str, str]] = {}
    for name, arts in artifacts.items():
        loaded[name], load_errors[name] = {}, {}
        for art in arts:
            if art.path is None:
                load_errors[name][art.format] = (
                    f"not exported ({art.error}); fix the cause or remove {art.format!r} from export.formats"
                )
                continue
            try:
                loaded[name][art.format] = exporting.load_artifact(art.path, art.format, threads)
            except Exception as exc:
                load_errors[name][art.format] = f"could not be loaded: {type(exc).__name__}: {str(exc)[:500]}"

    # parity
    start = time.perf_counter()
    checks: list[parity_mod.Check] = []
    layers: list[dict[str, Any]] = []
    ranges: dict[str, list[dict[str, Any]]] = {"weights": [], "activations": []}
    for name in targets:
        int8 = versions["int8"][name]
        batches = [exporting.positional_args(int8, inp) for inp in heldout[name]]
        candidates: dict[str, Optional[nn.Module | Callable[..., Any]]] = {
            "fp32": versions["fp32"][name],
            "fake_quant": versions.get("fake_quant", {}).get(name),
            "int8": int8,
            "int8_reference": references.get(name),
            **loaded[name],
        }
        outputs: dict[str, Optional[list[torch.Tensor]]] = {}
        errors = dict(load_errors[name])
        has_fake_quant = versions["fake_quant"].get(name) is not None
        if references.get(name) is None and has_fake_quant:
            errors["int8_reference"] = "the float-simulated int8 graph could not be built"
        for key, fn in candidates.items():
            if fn is None:
                outputs[key] = None
                continue
            try:
                outputs[key] = parity_mod.run_batches(fn, batches)
            except Exception as exc:
                outputs[key], errors[key] = None, f"{type(exc).__name__}: {str(exc)[:500]}"
        pairs: list[tuple[str, str, bool]] = [
            ("fake_quant", "fp32", False),
            ("int8", "fp32", False),
            ("int8", "fake_quant", False),
        ]
        if has_fake_quant:  # the float-simulated reference is built from the fake-quant model
            pairs.append(("int8", "int8_reference", True))
        pairs += [(fmt, "int8", True) for fmt in formats]
        if parity_cfg.get("enabled"):
            checks += parity_mod.compare(name, outputs, pairs, errors)
        if report_cfg.get("enabled") or parity_cfg.get("enabled"):  # the gate's message names the worst layers
            layer_batches = batches[: max(1, int(parity_cfg.get("layer_batches", 2)))]
            graph_versions = {
                "fp32": versions["fp32"][name],
                "fake_quant": versions.get("fake_quant", {}).get(name),
                "int8": source_of(int8),  # per-layer values need the graph, not a runtime wrapper
                "reference": references.get(name),
            }
            try:
                layers.extend(parity_mod.per_layer_sqnr(name, graph_versions, layer_batches))
                ranges["activations"] += parity_mod.activation_ranges(name, versions.get("fake_quant", {}).get(name), layer_batches)
                ranges["weights"] += parity_mod.weight_ranges(name, source_of(int8))
            except Exception as exc:
                warnings.warn(f"qlightning report: per-layer analysis of {name} failed: {exc}", stacklevel=2)
    timings["parity_s"] = time.perf_counter() - start
    breaches = parity_mod.gate(checks, float(parity_cfg["min_sqnr_db"]), float(parity_cfg["min_top1_agreement"]))
    samples = max((c.samples for c in checks), default=0)
    extra["parity"] = {
        "enabled": bool(parity_cfg.get("enabled")),
        "passed": not breaches,
        "on_breach": parity_cfg.get("on_breach"),
        "thresholds": {"min_sqnr_db": parity_cfg["min_sqnr_db"], "min_top1_agreement": parity_cfg["min_top1_agreement"]},
        "inputs": source,
        "samples": samples,
        "checks": [c.to_dict() for c in checks],
        "breaches": [f"{c.module}: {c.candidate} vs {c.reference}: " + "; ".join(p) for c, p in breaches],
    }
    if report_cfg.get("enabled") or parity_cfg.get("enabled"):
        extra["layers"] = layers
        extra["worst_layers"] = parity_mod.worst_layers(layers, "int8_sqnr_db", 5)
        extra["ranges"] = ranges
    if report_cfg.get("enabled"):

        # size on disk and latency, batch 1 and batch N
        start = time.perf_counter()
        batch_n = int(report_cfg.get("latency_batch_size") or 32)
        repeats = int(report_cfg.get("latency_repeats") or 30)
        sizes: dict[str, dict[str, Optional[int]]] = {}
        latency: dict[str, dict[str, dict[str, float]]] = {}
        old_threads = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        try:
            for name in targets:
                fp32 = versions["fp32"][name]
                sizes[name] = {"int8": state_dict_bytes(versions["int8"][name])}  # serialized state dicts
                if fp32 is not None:
                    skip = [n for n, _ in callback.engine.quant_state(fp32)]
                    sizes[name] = {"fp32": state_dict_bytes(fp32, skip=skip), **sizes[name]}
                sizes[name].update({a.format: a.size_bytes for a in artifacts[name] if a.size_bytes is not None})
                base = exporting.positional_args(versions["int8"][name], heldout[name][0])
                runners = {"fp32": fp32, "int8": versions["int8"][name], **loaded[name]}
                runners = {k: v for k, v in runners.items() if v is not None}
                latency[name] = {}
                for variant, fn in runners.items():
                    latency[name][variant] = {}
                    for batch in (1, batch_n):
                        try:
                            latency[name][variant][str(batch)] = _latency(fn, _tile_args(base, batch), repeats)
                        except Exception as exc:
                            warnings.warn(f"qlightning report: latency of {name}:{variant} failed: {exc}", stacklevel=2)
        finally:
            torch.set_num_threads(old_threads)
        extra["size_on_disk"] = sizes
        extra["latency_detail"] = {
            "batch_sizes": [1, batch_n],
            "threads": int(threads),
            "repeats": repeats,
            "ms": latency,
            "note": "median wall time of one forward; ONNX runs in onnxruntime (CPU provider)",
        }
        timings["latency_s"] = time.perf_counter() - start
        try:
            from qlightning import plots

            extra["plots"] = plots.render(extra, out_dir)
        except Exception as exc:  # matplotlib missing or broken: the report stays complete without PNGs
            extra["plots"] = {}
            warnings.warn(f"qlightning report: plots not written: {type(exc).__name__}: {exc}", stacklevel=2)
    extra["finalize_timings_s"] = {k: round(v, 3) for k, v in timings.items()}

    if breaches:
        message = parity_mod.breach_message(
            breaches, float(parity_cfg["min_sqnr_db"]), float(parity_cfg["min_top1_agreement"]), layers, source
        )
        extra["parity"]["message"] = message
        if parity_cfg.get("on_breach") == "fail":
            _write_report({**(base_report or {}), **extra}, out_dir)
            raise ParityError(message)
        warnings.warn(message, stacklevel=2)
    return extra


def finalize_run(callback: Any, model: Any, datamodule: Any, cfg: Any, run_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write exported artifacts and check parity; returns keys to merge into the report.

    Called by :func:`qlightning.app.train` on rank zero after the int8 model and the basic report exist.
    """
    if not getattr(callback, "converted", False):
        return {}
    export_cfg, parity_cfg, report_cfg = section(cfg, "export"), section(cfg, "parity"), section(cfg, "report")
    existing: dict[str, dict[str, Path]] = {}
    for name, path in (result.get("int8_models") or {}).items():
        if isinstance(path, str) and Path(path).is_file():
            existing[name] = {"torchscript": Path(path)}
    return export_and_check(
        callback,
        model,
        datamodule,
        Path(run_dir),
        export_cfg,
        parity_cfg,
        report_cfg,
        existing=existing,
        base_report=result,
    )


# ---------------------------------------------------------------------------------------------- markdown

SECTION_MARK = "## Exported artifacts"


def _fmt(value: Any, spec: str = ".1f", none: str = "") -> str:
    if value is None:
        return none
    return format(value, spec)


def markdown_sections(report: dict[str, Any]) -> str:
    """The report.md sections of exports, parity, per-layer SQNR, ranges, sizes and latency."""
    lines: list[str] = []
    exports = report.get("exports") or {}
    if exports:
        lines += ["", SECTION_MARK, "", "| module | format | file | size (KiB) | export (s) | status |", "|---|---|---|---|---|---|"]
        for module, by_format in exports.items():
            for fmt, a in by_format.items():
                size = a.get("size_bytes")
                status = "ok" if not a.get("error") else f"failed: {a['error'][:120]}"
                lines.append(
                    f"| {module} | {fmt} | {a.get('path') or ''} | {_fmt(size / 1024 if size else None)} | "
                    f"{_fmt(a.get('export_s'), '.2f')} | {status} |"
                )
        lines += ["", "Each artifact has a manifest `<file>.json` (inputs, outputs, backend, qparams, provenance)."]
    parity = report.get("parity") or {}
    if parity.get("checks"):
        th = parity.get("thresholds", {})
        verdict = "passed" if parity.get("passed") else f"FAILED (on_breach={parity.get('on_breach')})"
        lines += [
            "",
            "## Parity",
            "",
            f"Gate {verdict}: SQNR >= {th.get('min_sqnr_db')} dB and top-1 agreement >= {th.get('min_top1_agreement')} "
            f"for the gated rows; {parity.get('samples')} samples, {parity.get('inputs')}.",
            "",
            "| module | candidate | reference | SQNR (dB) | top-1 agreement | gated | result |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in parity["checks"]:
            result = ("pass" if c.get("passed") else "**FAIL**") if c.get("gated") else "info"
            if c.get("error"):
                result += f" ({c['error'][:100]})"
            lines.append(
                f"| {c['module']} | {c['candidate']} | {c['reference']} | {_fmt(c.get('sqnr_db'))} | "
                f"{_fmt(c.get('top1_agreement'), '.4f')} | {'yes' if c.get('gated') else 'no'} | {result} |"
            )
        lines += [
            "",
            "int8_reference = the same quantized graph simulated in float (decomposed reference model): int8 against "
            "it checks conversion and lowering; each artifact is checked against int8.",
        ]
    layers = report.get("layers") or []
    if layers:
        worst = report.get("worst_layers") or []
        lines += ["", "## Per-layer SQNR", ""]
        if worst:
            lines += [f"Five worst layers (int8 vs fp32): {', '.join(f'`{w}`' for w in worst)}.", ""]
        lines += ["| layer | fake-quant vs fp32 (dB) | int8 vs fp32 (dB) | int8 vs reference (dB) |", "|---|---|---|---|"]
        for row in layers:
            lines.append(
                f"| {row['layer']} | {_fmt(row.get('fake_quant_sqnr_db'))} | {_fmt(row.get('int8_sqnr_db'))} | "
                f"{_fmt(row.get('conversion_sqnr_db'))} |"
            )
    ranges = report.get("ranges") or {}
    if ranges.get("weights"):
        lines += ["", "## Weight ranges", "", "| layer | shape | dtype | scheme | float range | scale range |", "|---|---|---|---|---|---|"]
        for w in ranges["weights"]:
            lines.append(
                f"| {w['layer']} | {w['shape']} | {w['dtype']} | {w['qscheme']} | [{w['min']:.4g}, {w['max']:.4g}] | "
                f"[{w['scale_min']:.3g}, {w['scale_max']:.3g}] |"
            )
    if ranges.get("activations"):
        lines += [
            "",
            "## Activation ranges",
            "",
            "| after | scale | zero point | fake-quant range | observed (held-out, QAT model) | clipped by fake-quant | clipped by int8 |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in ranges["activations"]:
            observed = a.get("observed")
            lines.append(
                f"| {a['after']} | {a['scale']:.4g} | {a['zero_point']} | [{a['range'][0]:.4g}, {a['range'][1]:.4g}] | "
                + (f"[{observed[0]:.4g}, {observed[1]:.4g}]" if observed else "")
                + f" | {_fmt(a.get('clipped_fake_quant'), '.2%')} | {_fmt(a.get('clipped_int8'), '.2%')} |"
            )
    sizes = report.get("size_on_disk") or {}
    latency = report.get("latency_detail") or {}
    if sizes or latency.get("ms"):
        batches = [str(b) for b in latency.get("batch_sizes", [])]
        lines += [
            "",
            "## Size on disk and latency",
            "",
            f"Median of {latency.get('repeats')} runs, {latency.get('threads')} thread(s).",
            "",
            "| module | model | size (KiB) | " + " | ".join(f"ms, batch {b}" for b in batches) + " |",
            "|---|---|---|" + "---|" * len(batches),
        ]
        for module in sorted(set(sizes) | set(latency.get("ms", {}))):
            size_row = sizes.get(module, {})
            lat_row = latency.get("ms", {}).get(module, {})
            for variant in dict.fromkeys([*size_row, *lat_row]):
                size = size_row.get(variant)
                cells = [_fmt(lat_row.get(variant, {}).get(b), ".3f") for b in batches]
                label = f"{variant} (eager; size of the state dict)" if variant in ("fp32", "int8") else f"{variant} file"
                lines.append(f"| {module} | {label} | {_fmt(size / 1024 if size else None)} | " + " | ".join(cells) + " |")
    plots = report.get("plots") or {}
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name}]({path})" for name, path in plots.items()]
    return ("\n".join(lines) + "\n") if lines else ""
