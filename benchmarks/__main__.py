"""python -m benchmarks [table|scaling|profile|equivalence] ...: QAT cost and int8 speed, side by side.

``table`` (the default) measures, for the digits CNN, a ResNet-18-like CNN and a 4-layer Transformer
encoder, in one process per figure family, calls interleaved, medians of repeats:

* QAT train step / float train step (forward + backward + Adam) for the plain torch.ao baseline
  (``prepare_qat_fx``), qlightning's FX engine with its fast fake-quant path off and on (the default,
  ``qlightning/engines/fast_fq.py``), the latter with observers and BatchNorm frozen, and the
  qlightning PT2E engine;
* float eager latency / int8 latency at batch 1 and 32: FX eager int8 (torch.ao ``convert_fx``),
  onnxruntime on the QDQ ONNX export, inductor on the q/dq graph, torchao PT2E + inductor, and what
  ``qlightning.quantize.lowering.choose_lowering`` (``lowering=auto``) keeps;
* peak RSS growth of one train step and bytes saved for backward, QAT / float (fresh processes);
* FX prepare + convert time for 10 / 50 / 200 conv-bn-relu blocks and the first prepare in a fresh process.

Writes a new ``benchmarks/results/<full|quick>-<UTC time>.{md,json}`` and prints the table: a run never
replaces a committed results file unless asked (``--out PATH`` to choose the path, ``--overwrite`` to
replace an existing one; ``--overwrite`` alone replaces ``latest`` or, with ``--quick``, ``quick``).
``readme`` prints the README's benchmarks table generated from ``results/latest.json`` (``--write``:
into README.md).
Timings use the calling thread's CPU clock by default (``--clock cpu``; 1 thread): on a shared machine
it leaves out time spent preempted. Re-run on an idle machine for publishable numbers.

Examples::

    python -m benchmarks --quick                 # smoke run, < ~3 min on 2 cores
    python -m benchmarks --threads 1             # the full table (~15-25 min on 2 cores)
    python -m benchmarks --threads 1 --overwrite # ... replacing results/latest.{md,json}
    python -m benchmarks readme --write          # README's table from results/latest.json
    python -m benchmarks scaling --blocks 10,50,200,400
    python -m benchmarks profile --model resnet18_like --variant torch.ao
    python -m benchmarks equivalence             # fast path vs torch.ao after a few steps
    python -m benchmarks accuracy                # digits int8 accuracy, torch.ao vs fast path, 3 seeds
    python -m benchmarks options --model transformer --off fast_linear   # A/B of engine options
    python -m benchmarks compile                 # the compiled QAT path (engine_options.compile) vs eager and compiled float
    python -m benchmarks compile --engines fx,pt2e --models digits_cnn   # ... the PT2E engine's beside the FX engine's
    python -m benchmarks compile --models digits_cnn --batches 1,64     # ... at other batch sizes than the model's own
    python -m benchmarks fit                     # wall time of whole Trainer.fit runs: float, QAT defaults, compile=on
    python -m benchmarks peers --out benchmarks/results/peers   # NNCF, Brevitas, ModelOpt, torchao PT2E beside qlightning (bench extra)
    PYTHONPATH=. .venv214/bin/python -m benchmarks int8 --models shufflenet_v2_x0_5 --threads 2   # zoo int8 latency A/B
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MODEL_NAMES = ("digits_cnn", "resnet18_like", "transformer", "mobilenet_v2_like")


def _log(msg: str) -> None:
    print(f"[benchmarks {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine(args: argparse.Namespace) -> dict[str, Any]:
    import onnxruntime
    import torchao

    flags = ""
    try:
        flags = next(l for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        pass
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
    load = None
    try:
        load = open("/proc/loadavg").read().split()[:3]
    except OSError:
        pass
    return {
        "cpu": model,
        "isa": [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f" {f}" in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "onnxruntime": onnxruntime.__version__,
        "threads": args.threads,
        "clock": args.clock,
        "quick": args.quick,
        "load_average_at_start": load,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------------------------- table


def run_table(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import suites
    from benchmarks.models import model_spec

    names = args.models.split(",") if args.models else list(MODEL_NAMES)
    quick = args.quick
    results: dict[str, Any] = {"machine": machine(args), "models": {}}
    started = time.perf_counter()
    for name in names:
        spec = model_spec(name, quick)
        entry: dict[str, Any] = {"title": spec.title, "train_batch": spec.train_batch,
                                 "params_M": round(sum(p.numel() for p in spec.build().parameters()) / 1e6, 3)}
        small = name == "digits_cnn"
        step_repeats = args.repeats or (30 if small else 8) if quick else args.repeats or (100 if small else 20)
        _log(f"{name}: QAT step ({step_repeats} repeats)")
        entry["qat_step"] = suites.qat_step_ratios(spec, step_repeats, args.clock, pt2e=not quick or small)
        lat_repeats = args.repeats or (30 if small else 10) if quick else args.repeats or (100 if small else 30)
        if quick:
            candidates = {1: ("fx", "onnxruntime"), 32: ("fx", "onnxruntime") + (("inductor",) if small else ())}
            pt2e_batches: tuple[int, ...] = (32,) if small else ()
        else:
            candidates = {1: ("fx", "onnxruntime", "inductor"), 32: ("fx", "onnxruntime", "inductor")}
            pt2e_batches = (32,)
        _log(f"{name}: int8 latency ({lat_repeats} repeats; candidates {candidates})")
        entry["latency"] = suites.latency(spec, (1, 32), lat_repeats, args.clock, candidates, pt2e_batches,
                                          train_steps=10 if quick else 30)
        if not args.skip_memory:
            _log(f"{name}: memory (fresh process)")
            entry["memory"] = suites.memory(name, quick)
        results["models"][name] = entry
    if not args.skip_scaling:
        blocks = (10, 50) if quick else (10, 50, 200)
        _log(f"prepare+convert scaling {blocks}")
        results["scaling"] = suites.prepare_convert_scaling(blocks)
        results["cold_prepare"] = suites.cold_prepare()
    results["wall_s"] = round(time.perf_counter() - started, 1)
    return results


def _fmt(v: Any, suffix: str = "x") -> str:
    return "n/a" if v is None else f"{v:.2f}{suffix}"


def render(results: dict[str, Any]) -> str:
    m = results["machine"]
    models = results["models"]
    names = list(models)
    head = "| figure | " + " | ".join(models[n]["title"] for n in names) + " |"
    lines = [
        f"# qlightning benchmarks ({'quick' if m['quick'] else 'full'})",
        "",
        f"{m['cpu']} ({', '.join(m['isa'])}; torch {m['torch']}, capability {m['torch_cpu_capability']}), torchao "
        f"{m['torchao']}, onnxruntime {m['onnxruntime']}; {m['threads']} thread(s), {m['clock']} clock, medians "
        f"of interleaved repeats; load average at start {m['load_average_at_start']}. Wall time {results.get('wall_s')} s.",
        "",
        head,
        "|---|" + "---|" * len(names),
    ]

    def row(label: str, get: Any) -> None:
        cells = []
        for n in names:
            try:
                cells.append(get(models[n]))
            except (KeyError, TypeError, ZeroDivisionError):
                cells.append("n/a")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    step_rows = [
        ("torch.ao FX", "QAT train step / float step: torch.ao FX (`prepare_qat_fx`, fused fake-quant)"),
        ("qlightning FX, fast path off", "... qlightning FX engine, `engine_options.fast_qat=false`"),
        ("qlightning FX", "... qlightning FX engine (default: fast fake-quant & conv-bn)"),
        ("qlightning FX, observers+BN frozen", "... same, observers and BN frozen (late QAT phase)"),
        ("qlightning FX, float warm-up", "... same, the float warm-up (fake-quant off, activations calibrating)"),
        ("qlightning PT2E", "... qlightning PT2E engine"),
    ]
    for key, label in step_rows:
        row(label, lambda e, k=key: _fmt(e["qat_step"]["over_float"][k]))
    row("float train step (ms, batch)", lambda e: f"{e['qat_step']['step_ms']['float']:.1f} (bs {e['qat_step']['batch']})")
    lat_rows = [
        ("1", "fx", "float eager / FX int8 (torch.ao `convert_fx`), batch 1"),
        ("32", "fx", "float eager / FX int8, batch 32"),
        ("32", "pt2e+inductor (torchao)", "float eager / PT2E int8 + inductor (torchao), batch 32"),
        ("32", "inductor", "float eager / qlightning q/dq graph + inductor, batch 32"),
        ("1", "onnxruntime", "float eager / onnxruntime int8 QDQ, batch 1"),
        ("32", "onnxruntime", "float eager / onnxruntime int8 QDQ, batch 32"),
        ("1", "inductor", "float eager / qlightning q/dq graph + inductor, batch 1"),
    ]
    for batch, key, label in lat_rows:
        row(label, lambda e, b=batch, k=key: _fmt(e["latency"][b]["float_over"][k]))
    for batch in ("1", "32"):
        row(f"float eager / `lowering=auto` pick, batch {batch}",
            lambda e, b=batch: f"{_fmt(e['latency'][b]['float_over']['lowering=auto'])} ({e['latency'][b]['lowering']['name']})")
    row("float eager latency (ms), batch 1 / 32",
        lambda e: f"{e['latency']['1']['latency_ms']['float']:.3f} / {e['latency']['32']['latency_ms']['float']:.2f}")
    row("peak RSS growth in a train step, QAT / float: torch.ao FX",
        lambda e: _fmt(e["memory"]["torch.ao FX"]["rss_over_float"]))
    row("... qlightning FX (default)", lambda e: _fmt(e["memory"]["qlightning FX"]["rss_over_float"]))
    row("saved-for-backward bytes, QAT / float: torch.ao FX", lambda e: _fmt(e["memory"]["torch.ao FX"]["saved_over_float"]))
    row("... qlightning FX (default)", lambda e: _fmt(e["memory"]["qlightning FX"]["saved_over_float"]))
    row("float step: RSS growth / saved bytes (MiB)",
        lambda e: f"{e['memory']['float']['rss_growth_kb'] / 1024:.1f} / {e['memory']['float']['saved_for_backward_bytes'] / 2**20:.1f}")
    lines.append("")
    lines.append("Parity of the `lowering=auto` candidates over 32 samples (output SQNR dB vs the fake-quant model / "
                 "top-1 agreement; float models warm-trained for a few steps on random data, then QAT-prepared and "
                 "calibrated, not QAT-trained; a candidate passes at >= 25 dB and 99%, or when within 1 dB / 1 point "
                 "of the FX int8 module) and what building it cost:")
    lines.append("")
    for n in names:
        for b in ("1", "32"):
            try:
                low = models[n]["latency"][b]["lowering"]
            except KeyError:
                continue
            parts = [f"{c}: {low['sqnr_db'].get(c, 'n/a')} dB / {low['top1_agreement'].get(c)}" + (" (rejected)" if c in low["errors"] else "")
                     for c in low["latency_ms"]]
            lines.append(f"- {models[n]['title']}, batch {b}: " + "; ".join(parts) + f"; build s {low['build_s']}")
    if "scaling" in results:
        lines += ["", "| FX prepare + convert (warm process; thread CPU s) | prepare | convert | total | total, wall |",
                  "|---|---|---|---|---|"]
        for key, v in results["scaling"].items():
            lines.append(f"| {key.split(':')[1]} conv-bn-relu blocks ({key.split(':')[0]}) | {v['prepare_s']:.2f} | "
                         f"{v['convert_s']:.2f} | {v['total_s']:.2f} | {v.get('wall_s', float('nan')):.2f} |")
        cold = results.get("cold_prepare", {})
        if "first_prepare_s" in cold:
            lines.append("")
            lines.append(f"First FX prepare of the digits CNN in a fresh process: {cold['first_prepare_s']:.2f} s "
                         f"(second: {cold['second_prepare_s']:.2f} s; `import torch, qlightning`: {cold['import_s']:.2f} s).")
    lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- other commands


def run_scaling(args: argparse.Namespace) -> None:
    from benchmarks import suites

    blocks = tuple(int(b) for b in args.blocks.split(","))
    engines = tuple(args.engines.split(","))
    if args.profile:
        import cProfile
        import pstats

        from benchmarks.models import ConvBnReluChain
        from qlightning import Inputs, QuantSpec, get_engine

        eng = get_engine(engines[0])
        x = torch.randn(2, 1, 8, 8)
        suites.prepare_convert_scaling((2,), engines[:1])
        profiler = cProfile.Profile()
        model = ConvBnReluChain(blocks[-1])
        profiler.enable()
        with suites.quiet():
            prepared = eng.prepare(model, Inputs((x,)), QuantSpec(backend="x86"))
            eng.convert(prepared, QuantSpec(backend="x86"))
        profiler.disable()
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(args.top)
        return
    print(json.dumps(suites.prepare_convert_scaling(blocks, engines), indent=2))


def run_profile(args: argparse.Namespace) -> None:
    """torch.profiler table (and optionally cProfile) of a few train steps of one variant."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import suites
    from benchmarks.models import model_spec

    spec = model_spec(args.model, args.quick)
    torch.manual_seed(0)
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    model = spec.build()
    if args.variant == "torch.ao":
        model = suites.set_phase(suites.torchao_fx_prepare(model, x[:1]), suites.QAT_ON)
    elif args.variant == "fast":
        model = suites.set_phase(suites.qlightning_prepare(model, x[:1]), suites.QAT_ON)
    elif args.variant == "pt2e":
        model = suites.set_phase(suites.qlightning_prepare(model, x[:1], "pt2e"), suites.QAT_ON, "pt2e")
    step = suites.train_step(model, x, y)
    for _ in range(3):
        step()
    if args.cprofile:
        import cProfile
        import pstats

        profiler = cProfile.Profile(timer=time.thread_time)
        profiler.enable()
        for _ in range(args.steps):
            step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


def run_equivalence(args: argparse.Namespace) -> None:
    from benchmarks import suites
    from benchmarks.models import model_spec

    out = {name: suites.fast_path_equivalence(model_spec(name, True), steps=args.steps) for name in MODEL_NAMES}
    print(json.dumps(out, indent=2))


def run_options(args: argparse.Namespace) -> None:
    """QAT step / float step of the FX engine as shipped vs with some ``engine_options`` off, interleaved."""
    from benchmarks import suites
    from benchmarks.models import model_spec
    from benchmarks.timing import interleaved_medians, medians
    from qlightning import Inputs, QuantSpec, get_engine

    spec = model_spec(args.model, args.quick)
    torch.manual_seed(0)
    float_model = spec.build()
    x, y = spec.inputs(spec.train_batch), spec.labels(spec.train_batch)
    off = {name: False for name in args.off.split(",") if name}

    def prepared(options: dict) -> torch.nn.Module:
        module = get_engine("fx").prepare(copy.deepcopy(float_model), Inputs((x[:1],)), QuantSpec(backend="x86", options=options))
        return suites.set_phase(module, suites.QAT_ON)

    variants = {"float": float_model, "default": prepared({}), f"off: {','.join(off)}": prepared(off)}
    fns = {name: suites.train_step(m, x, y) for name, m in variants.items()}
    med = medians(interleaved_medians(fns, args.repeats or 15, warmup=2, clock=args.clock))
    print(json.dumps({name: round(value / med["float"], 3) for name, value in med.items()}, indent=2))


def run_int8(args: argparse.Namespace) -> None:
    """Eager latency of zoo models (``tests/zoo``, torchvision / timm): float, the FX engine's int8 module as shipped, and
    the same convert without ``requantize_as_trained`` (torch.ao's graph, no fidelity rewrites), calls interleaved,
    wall-clock medians at batch 1 and 32; the int8 modules come from a prepared model that observed 3 random batches
    (latency does not depend on the weights). Writes results/int8-<time>.json."""
    import torch.ao.quantization as tq

    from benchmarks.suites import quiet
    from benchmarks.timing import interleaved_medians, medians
    from qlightning import QuantizationAwareTraining
    from qlightning.examples.digits import ClassifierModule
    from tests.zoo.harness import MODELS

    names = args.models.split(",") if args.models else ["resnet18", "mobilenet_v2", "shufflenet_v2_x0_5", "regnet_x_400mf"]
    out: dict = {"machine": machine(args), "repeats": args.repeats or 30, "models": {}}
    for name in names:
        spec = MODELS[name]
        int8 = {}
        for label, options in (("int8", {}), ("int8, requantize_as_trained=false", {"requantize_as_trained": False})):
            torch.manual_seed(0)
            model = ClassifierModule(spec.build())
            model.example_input_array = torch.zeros(2, 3, 32, 32)
            engine_options = {**spec.options.get("engine_options", {}), **options}
            qat = QuantizationAwareTraining(modules=["net"], engine="fx", **{**spec.options, "engine_options": engine_options})
            with quiet():
                qat.prepare(model)
                model.train()
                model.net.apply(tq.enable_observer)
                model.net.apply(tq.enable_fake_quant)
                with torch.no_grad():
                    for _ in range(3):
                        model.net(torch.randn(32, 3, 32, 32))
                qat.convert(model)
            int8[label] = model.net.eval()
        float_model = spec.build().eval()
        row = {}
        for batch in (1, 32):
            x = torch.randn(batch, 3, 32, 32)
            fns = {"float": lambda: float_model(x), **{k: (lambda m=m: m(x)) for k, m in int8.items()}}
            with torch.no_grad():
                med = medians(interleaved_medians(fns, args.repeats or 30, warmup=3, clock="wall"))
            row[f"batch {batch}"] = {"ms": {k: round(v * 1e3, 3) for k, v in med.items()},
                                     "speed_up_over_float": {k: round(med["float"] / v, 2) for k, v in med.items() if k != "float"}}
        out["models"][name] = row
        print(json.dumps({name: row}, indent=2), flush=True)
    path = Path(args.out).with_suffix(".json") if args.out else RESULTS / f"int8-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    _log(f"wrote {path}")


def run_compile(args: argparse.Namespace) -> None:
    """The compiled QAT training path beside eager and compiled float, per model; writes results/compile-<time>.json."""
    from benchmarks import suites
    from benchmarks.models import model_spec

    names = [n for n in (args.models.split(",") if args.models else MODEL_NAMES)]
    # each model at its own training batch, or (--batches) at each batch given, keyed "<model>, batch <n>"
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [None]
    out = {"machine": machine(args), "models": {}}
    for name in names:
        for batch in batches:
            spec = model_spec(name, args.quick)
            key = name if batch is None else f"{name}, batch {batch}"
            if batch is not None:
                spec = dataclasses.replace(spec, train_batch=batch)
            _log(f"compile: {key}")
            out["models"][key] = suites.compiled_step_ratios(spec, args.repeats or 20, args.clock,
                                                             tuple(args.engines.split(",")), args.inductor_defaults)
            print(json.dumps({key: out["models"][key]}, indent=2), flush=True)
    path = Path(args.out).with_suffix(".json") if args.out else RESULTS / f"compile-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    if path.exists() and not args.overwrite:
        raise SystemExit(f"{path} exists; --overwrite to replace it")
    path.write_text(json.dumps(out, indent=2) + "\n")
    _log(f"wrote {path}")


def run_steps(args: argparse.Namespace) -> None:
    """QAT step / float step per model at each of ``--batches``, observing and frozen; writes
    results/steps-<time>.json (``--out``), whose figures the README's table shows."""
    from benchmarks import suites
    from benchmarks.models import model_spec

    names = args.models.split(",") if args.models else list(MODEL_NAMES)
    batches = [int(b) for b in (args.batches or "1,32,64").split(",")]
    path = Path(args.out).with_suffix(".json") if args.out else RESULTS / f"steps-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    if path.exists() and not args.overwrite:
        raise SystemExit(f"{path} exists; --overwrite to replace it")
    out: dict[str, Any] = {"machine": machine(args), "models": {}}
    started = time.perf_counter()
    for name in names:
        spec = model_spec(name, args.quick)
        out["models"][name] = {"title": spec.title, "batches": {}}
        for batch in batches:
            # a step's cost grows with the batch: fewer repeats for the large ones keep each model near a minute
            repeats = args.repeats or max(8, min(100, int(400 / max(1, batch)) if name != "digits_cnn" else 100))
            _log(f"steps: {name} batch {batch} ({repeats} repeats)")
            figures = suites.step_ratios_by_batch(spec, batch, repeats, args.clock)
            out["models"][name]["batches"][str(batch)] = figures
            print(json.dumps({name: {batch: figures["over_float"]}}), flush=True)
    out["wall_s"] = round(time.perf_counter() - started, 1)
    path.write_text(json.dumps(out, indent=2) + "\n")
    _log(f"wrote {path}")


def run_peers(args: argparse.Namespace) -> None:
    """Other QAT libraries' train step beside qlightning's and torch.ao's (``benchmarks/peers.py``); writes
    results/peers-<time>.json (``--out``), whose figures the README's table shows."""
    from benchmarks import peers

    path = Path(args.out).with_suffix(".json") if args.out else RESULTS / f"peers-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    if path.exists() and not args.overwrite:
        raise SystemExit(f"{path} exists; --overwrite to replace it")
    started = time.perf_counter()
    out = {"machine": machine(args), **peers.run(args.models.split(",") if args.models else list(MODEL_NAMES),
                                                 args.repeats or None, args.clock)}
    out["wall_s"] = round(time.perf_counter() - started, 1)
    for name, figures in out["models"].items():
        print(json.dumps({name: {"over_float": figures["over_float"], "errors": figures["errors"]}}), flush=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    _log(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("command", nargs="?", default="table", choices=("table", "scaling", "profile", "equivalence", "accuracy", "options", "readme", "compile", "fit", "int8", "steps", "peers"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--repeats", type=int, default=0, help="repeats per timing (default: per model and mode)")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer candidates (< ~3 min on 2 cores)")
    parser.add_argument("--clock", default="cpu", choices=("cpu", "wall"), help="thread CPU time (default) or wall time")
    parser.add_argument("--epochs", default="", help="fit: comma-separated fit lengths in epochs (default 3,10,30)")
    parser.add_argument("--process", default="fresh", choices=("fresh", "shared"),
                        help="fit: each fit in a new process, as a user's run (default), or all in this one")
    parser.add_argument("--models", default="", help=f"comma-separated subset of {','.join(MODEL_NAMES)} (int8: tests/zoo model names)")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument("--out", "--output", dest="out", default=None,
                        help="results path without extension (default: a new results/<full|quick>-<UTC time>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing results file (alone: results/latest, or results/quick with --quick)")
    # readme
    parser.add_argument("--results", default=None, help="readme: the results JSON (default: results/latest.json)")
    parser.add_argument("--write", action="store_true", help="readme: put the table into README.md")
    # scaling
    parser.add_argument("--batches", default="", help="steps: comma-separated batch sizes (default 1,32,64); "
                        "compile: the batch sizes to time each model at (default: its training batch)")
    parser.add_argument("--inductor-defaults", action="store_true", help="compile: also the FX compiled path with "
                        "inductor's default options (its wrapper's size asserts on), side by side")
    parser.add_argument("--blocks", default="10,50,200")
    parser.add_argument("--engines", default="fx", help="scaling, compile, fit: comma-separated engines (fx, pt2e; default fx)")
    parser.add_argument("--profile", action="store_true", help="scaling: cProfile the largest size instead")
    parser.add_argument("--sort", default="cumulative")
    # profile
    parser.add_argument("--model", default="resnet18_like", choices=MODEL_NAMES)
    parser.add_argument("--variant", default="torch.ao", choices=("float", "torch.ao", "fast", "pt2e"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--top", type=int, default=30)
    # options
    parser.add_argument("--off", default="fast_linear", help="options: comma-separated FX engine options to turn off in the B arm")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    if args.command == "scaling":
        return run_scaling(args)
    if args.command == "profile":
        return run_profile(args)
    if args.command == "equivalence":
        return run_equivalence(args)
    if args.command == "options":
        return run_options(args)
    if args.command == "readme":
        from benchmarks import readme

        readme.main(Path(args.results) if args.results else readme.RESULTS_FILE, write=args.write)
        return None
    if args.command == "compile":
        return run_compile(args)
    if args.command == "int8":
        return run_int8(args)
    if args.command == "steps":
        return run_steps(args)
    if args.command == "peers":
        return run_peers(args)
    if args.command == "fit":
        from benchmarks import suites

        epochs = tuple(int(e) for e in args.epochs.split(",")) if args.epochs else (3, 10, 30)
        models = tuple(args.models.split(",")) if args.models else suites.FIT_MODELS
        result = {"machine": machine(args), "fits": suites.fit_wall_times(epochs, args.repeats or 3, models,
                                                                                    fresh_process=args.process == "fresh",
                                                                                    engines=tuple(args.engines.split(",")))}
        path = Path(args.out).with_suffix(".json") if args.out else RESULTS / f"fit-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["fits"], indent=2))
        return None
    if args.command == "accuracy":
        from benchmarks import suites

        print(json.dumps(suites.digits_accuracy(), indent=2))
        return None
    out = output_path(args)  # before measuring: a refused path costs nothing
    results = run_table(args)
    table = render(results)
    write_results(results, table, out, args.overwrite)
    print(table)
    _log(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}")


def output_path(args: argparse.Namespace, now: float | None = None) -> Path:
    """Where the table's results go, without extension; refuses an existing file unless ``--overwrite``.

    Default: a new ``results/<full|quick>-<UTC time>`` (the committed files are never replaced by accident).
    """
    if args.out:
        out = Path(args.out)
    elif args.overwrite:
        out = RESULTS / ("quick" if args.quick else "latest")
    else:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
        out = RESULTS / f"{'quick' if args.quick else 'full'}-{stamp}"
    existing = [p for p in (out.with_suffix(".md"), out.with_suffix(".json")) if p.exists()]
    if existing and not args.overwrite:
        raise SystemExit(f"python -m benchmarks: {existing[0]} exists; pass --overwrite to replace it, or --out PATH")
    return out


def write_results(results: dict[str, Any], table: str, out: Path, overwrite: bool) -> None:
    """Write ``<out>.json`` and ``<out>.md``; an existing file is replaced only with ``overwrite``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    mode = "w" if overwrite else "x"  # "x": never replace a file that appeared while measuring
    with open(out.with_suffix(".json"), mode) as fh:
        fh.write(json.dumps(results, indent=2, default=str))
    with open(out.with_suffix(".md"), mode) as fh:
        fh.write(table)


if __name__ == "__main__":
    main()
