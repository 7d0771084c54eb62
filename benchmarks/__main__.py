"""python -m benchmarks [--threads N] [--repeats N]: QAT cost and int8 speed-up, side by side.

Every ratio is taken from timings made in one process, interleaved, median of repeats:
- QAT train step / float train step (forward + backward + Adam step, batch 64, fake-quant and
  observers on) for the digits CNN;
- float eager latency / int8 latency at batch 1 and batch 32.
Writes benchmarks/results/latest.json and latest.md and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from qlightning import Inputs, Phase, QuantSpec, get_engine
from qlightning.examples.digits import DigitsCNN, DigitsDataModule

RESULTS = Path(__file__).resolve().parent / "results"


def interleaved_medians(fns: dict, repeats: int, warmup: int = 10) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def train_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def infer_fn(model: nn.Module, x: torch.Tensor):
    model.eval()

    def run() -> None:
        with torch.inference_mode():
            model(x)

    return run


def digits_cnn(repeats: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    dm.setup()
    x_all, y_all = dm.splits["train"].tensors
    x, y = x_all[:64], y_all[:64]
    engine = get_engine("fx")
    float_model = DigitsCNN()
    spec = QuantSpec(backend="x86")
    qat_model = engine.prepare(copy.deepcopy(float_model), Inputs((x[:1],)), spec)
    engine.set_phase(qat_model, Phase(fake_quant=True, observe=True, bn_frozen=False))
    steps = interleaved_medians(
        {"float": train_step_fn(float_model, x, y), "qat": train_step_fn(qat_model, x, y)}, repeats
    )
    int8_model = engine.convert(copy.deepcopy(qat_model), spec)
    float_model.eval()
    latency = {}
    for batch in (1, 32):
        xb = x_all[:batch]
        latency[batch] = interleaved_medians({"float": infer_fn(float_model, xb), "int8": infer_fn(int8_model, xb)}, repeats)
    return {
        "qat_step_over_float_step": steps["qat"] / steps["float"],
        "float_step_ms": steps["float"] * 1e3,
        "qat_step_ms": steps["qat"] * 1e3,
        "float_over_int8_latency_bs1": latency[1]["float"] / latency[1]["int8"],
        "float_over_int8_latency_bs32": latency[32]["float"] / latency[32]["int8"],
        "latency_ms": {str(b): {k: v * 1e3 for k, v in t.items()} for b, t in latency.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": args.threads, "repeats": args.repeats},
        "digits_cnn": digits_cnn(args.repeats),
    }
    r = results["digits_cnn"]
    table = "\n".join([
        f"| figure (digits CNN, {args.threads} thread(s), median of {args.repeats}) | qlightning FX |",
        "| --- | --- |",
        f"| QAT train step / float step (batch 64) | {r['qat_step_over_float_step']:.2f}x |",
        f"| float eager / int8 latency, batch 1 | {r['float_over_int8_latency_bs1']:.2f}x |",
        f"| float eager / int8 latency, batch 32 | {r['float_over_int8_latency_bs32']:.2f}x |",
    ])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=2))
    (RESULTS / "latest.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
