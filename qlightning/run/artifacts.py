"""After fit: exports, the parity gate and the extended report (issue 7).

:func:`finalize_run` is called by :func:`qlightning.run.app.train` on rank zero once the int8 model and the
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

from qlightning.core.inputs import Inputs, positional_args, slice_rows, source_of, tile
from qlightning.core.metrics import median_ms
from qlightning.core.session import session_of
from qlightning.run import export as exporting
from qlightning.run import parity as parity_mod
from qlightning.run import plots
from qlightning.run.parity import ParityError
from qlightning.run.report import SECTION_MARK, evaluation_trainer, markdown_sections, state_dict_bytes
from qlightning.run import report as reporting

__all__ = ["finalize_run", "export_and_check", "markdown_sections", "ParityError"]


# ---------------------------------------------------------------------------------------------- config


def _eval_trainer_factory() -> Callable[[int], Any]:
    return evaluation_trainer


# ---------------------------------------------------------------------------------------------- helpers


def _write_report(report: dict[str, Any], run_dir: Path) -> None:
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
    session: Any,
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

    Args:
        session: the :class:`~qlightning.core.session.QuantSession`, or a callback that holds one.
        model: the LightningModule, with its converted int8 submodules.
        datamodule: the data whose test loader gives the held-out batches (the captured example inputs
            are used when it cannot).
        out_dir: the run folder the artifacts, plots and report go to (created if missing).
        export_cfg: the ``export`` section (``formats``, ``dynamic_batch``, ``onnx_opset``, ``pt2_ops``).
        parity_cfg: the ``parity`` section (``enabled``, ``batches``, ``on_breach``, thresholds).
        report_cfg: the ``report`` section (``enabled``, ``latency_threads``, ``latency_batch_size``,
            ``latency_repeats``).
        existing: ``{submodule: {format: file}}`` of artifacts already written, not exported again.
        base_report: the report so far, merged under these keys when the failure report is written.
        trainer_factory: makes a Trainer limited to a number of test batches; ``None`` uses
            :func:`~qlightning.run.report.evaluation_trainer`.
    """
    session = session_of(session)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = list(session.targets)
    formats = [str(f) for f in export_cfg.get("formats") or []]
    threads = report_cfg.get("latency_threads") or torch.get_num_threads()
    try:
        versions = session.variants(model)
    except KeyError:  # a callback that keeps no fake-quant copy: int8 (and its exports) only
        versions = {
            "fp32": {n: None for n in targets},
            "fake_quant": {n: None for n in targets},
            "int8": {n: model.get_submodule(n) for n in targets},
        }
    versions.setdefault("fake_quant", {n: None for n in targets})  # PostTrainingQuantization keeps none
    limits = session.export_limits()
    factory = trainer_factory or _eval_trainer_factory()
    extra: dict[str, Any] = {"labels": reporting.variant_labels(session, versions)}
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
            heldout[name] = [session.inputs[name]]
            source = "example inputs (the quantized modules saw no test batch)"
    timings["capture_s"] = time.perf_counter() - start

    # exports
    start = time.perf_counter()
    artifacts: dict[str, list[exporting.Artifact]] = {}
    references: dict[str, Optional[nn.Module]] = {}
    for name in targets:
        example = slice_rows(heldout[name][0], 2)
        artifacts[name], references[name] = exporting.export_module(
            session,
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
        if references[name] is None and not any(f in ("onnx", "pt2") for f in formats) and "reference" not in limits:
            try:  # the gate's int8 reference, even when no ONNX/.pt2 export was asked for
                references[name] = session.reference_module(name)
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
    not_checked: dict[str, str] = {}
    layers: list[dict[str, Any]] = []
    ranges: dict[str, list[dict[str, Any]]] = {"weights": [], "activations": []}
    for name in targets:
        int8 = versions["int8"][name]
        batches = [positional_args(int8, inp) for inp in heldout[name]]
        # the quantized weights run in float: the reference of quantization error (drift kept apart)
        same_weights = versions.get("trained_float", versions["fp32"])[name]
        candidates: dict[str, Optional[nn.Module | Callable[..., Any]]] = {
            "fp32": versions["fp32"][name],
            "trained_float": versions.get("trained_float", {}).get(name),
            "fake_quant": versions.get("fake_quant", {}).get(name),
            "int8": int8,
            "int8_reference": references.get(name),
            **loaded[name],
        }
        outputs: dict[str, Optional[list[torch.Tensor]]] = {}
        errors = dict(load_errors[name])
        has_fake_quant = versions["fake_quant"].get(name) is not None
        if references.get(name) is None and has_fake_quant and "reference" not in limits:
            errors["int8_reference"] = "the float-simulated int8 graph could not be built"
        for key, fn in candidates.items():
            if fn is None:
                outputs[key] = None
                continue
            try:
                outputs[key] = parity_mod.run_batches(fn, batches)
            except Exception as exc:
                outputs[key], errors[key] = None, f"{type(exc).__name__}: {str(exc)[:500]}"
        float_key = "trained_float" if "trained_float" in versions else "fp32"
        pairs: list[tuple[str, str, bool]] = [
            ("fake_quant", float_key, False),
            ("int8", float_key, False),
            ("int8", "fake_quant", False),
        ]
        if float_key == "trained_float":  # training drift: the trained float weights against the snapshot
            pairs.append(("trained_float", "fp32", False))
        if "reference" in limits:  # known before training (the engine says why); recorded, not a breach
            not_checked[f"{name}: int8 vs int8_reference"] = limits["reference"]
        elif has_fake_quant or references.get(name) is not None:  # built from the fake-quant (QAT) or calibrated (PTQ) model
            pairs.append(("int8", "int8_reference", True))
        pairs += [(fmt, "int8", True) for fmt in formats]
        if parity_cfg.get("enabled"):
            checks += parity_mod.compare(name, outputs, pairs, errors)
        if report_cfg.get("enabled") or parity_cfg.get("enabled"):  # the gate's message names the worst layers
            layer_batches = batches[: max(1, int(parity_cfg.get("layer_batches", 2)))]
            graph_versions = {
                "snapshot": versions["fp32"][name],
                "float": same_weights,
                "fake_quant": versions.get("fake_quant", {}).get(name),
                "int8": source_of(int8),  # per-layer values need the graph, not a runtime wrapper
                "reference": references.get(name),
            }
            layer_pairs = [  # quantization: against the same weights in float; drift: float against float
                ("fake_quant_vs_float_sqnr_db", "fake_quant", "float"),
                ("int8_vs_float_sqnr_db", "int8", "float"),
                ("conversion_sqnr_db", "int8", "reference"),
            ]
            if float_key == "trained_float":
                layer_pairs.insert(0, ("drift_sqnr_db", "float", "snapshot"))
            try:
                layers.extend(parity_mod.per_layer_sqnr(name, graph_versions, layer_batches, layer_pairs))
                ranges["activations"] += parity_mod.activation_ranges(
                    name, versions.get("fake_quant", {}).get(name), layer_batches, same_weights
                )
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
        "not_checked": not_checked,
    }
    if report_cfg.get("enabled") or parity_cfg.get("enabled"):
        extra["layers"] = layers
        extra["worst_layers"] = reporting.flag_worst_layers(layers)
        extra["worst_layers_rule"] = reporting.WORST_LAYERS_RULE
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
                    skip = [n for n, _ in session.engine.quant_state(fp32)]
                    sizes[name] = {"fp32": state_dict_bytes(fp32, skip=skip), **sizes[name]}
                sizes[name].update({a.format: a.size_bytes for a in artifacts[name] if a.size_bytes is not None})
                base = positional_args(versions["int8"][name], heldout[name][0])
                runners = {"fp32": fp32, "ptq": versions.get("ptq", {}).get(name), "int8": versions["int8"][name], **loaded[name]}
                runners = {k: v for k, v in runners.items() if v is not None}
                latency[name] = {variant: {} for variant in runners}
                for batch in (1, batch_n):
                    args = tile(tuple(base), batch)
                    usable = {}
                    for variant, fn in runners.items():  # one untimed call first: a runner that fails is left out
                        try:
                            with torch.inference_mode():
                                fn(*args)
                            usable[variant] = fn
                        except Exception as exc:
                            warnings.warn(f"qlightning report: latency of {name}:{variant} failed: {exc}", stacklevel=2)
                    # one measurement of every variant, blocks taken in turn: load changes hit them alike
                    timed = median_ms({k: (lambda fn=fn, args=args: fn(*args)) for k, fn in usable.items()}, repeats)
                    for variant, ms in timed.items():
                        latency[name][variant][str(batch)] = round(ms, 4)
        finally:
            torch.set_num_threads(old_threads)
        extra["size_on_disk"] = sizes
        extra["latency_detail"] = {
            "batch_sizes": [1, batch_n],
            "threads": int(threads),
            "repeats": repeats,
            "ms": latency,
            "note": "median wall time of one forward, every model's calls in blocks taken in turn in one measurement; "
                    "ONNX runs in onnxruntime (CPU provider)",
        }
        # the headline (report.md's first table, the console table) shows these same numbers
        extra["latency_ms"] = {
            variant: round(sum(latency[n][variant][str(batch_n)] for n in targets), 4)
            for variant in ("fp32", "ptq", "int8")
            if all(str(batch_n) in latency.get(n, {}).get(variant, {}) for n in targets)
        }
        extra["latency_batch_size"] = batch_n
        extra["latency_threads"] = int(threads)
        timings["latency_s"] = time.perf_counter() - start
        try:
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


def finalize_run(session: Any, model: Any, datamodule: Any, cfg: Any, run_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write exported artifacts and check parity; returns keys to merge into the report.

    ``cfg`` holds the ``export``, ``parity`` and ``report`` sections as plain dicts
    (:func:`qlightning.config.export_schema.section` of a run's config).

    Called by :func:`qlightning.run.app.train` on rank zero after the int8 model and the basic report exist.

    Args:
        session: the :class:`~qlightning.core.session.QuantSession`, or a callback that holds one; nothing
            is done (``{}``) if it has not converted.
        model: the LightningModule with its int8 submodules.
        datamodule: the run's data (its test loader gives the held-out batches).
        cfg: the ``export``, ``parity`` and ``report`` sections.
        run_dir: the run folder.
        result: the basic report; its ``int8_models`` TorchScript files are reused, and it is the base of
            a failure report.
    """
    session = session_of(session)
    if not session.converted:
        return {}
    export_cfg, parity_cfg, report_cfg = cfg["export"], cfg["parity"], cfg["report"]
    existing: dict[str, dict[str, Path]] = {}
    for name, path in (result.get("int8_models") or {}).items():
        if isinstance(path, str) and Path(path).is_file():
            existing[name] = {"torchscript": Path(path)}
    return export_and_check(
        session,
        model,
        datamodule,
        Path(run_dir),
        export_cfg,
        parity_cfg,
        report_cfg,
        existing=existing,
        base_report=result,
    )


