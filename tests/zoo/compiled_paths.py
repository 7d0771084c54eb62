"""Each zoo model through each engine's compiled training path, against the same module run eagerly.

    PYTHONPATH=. .venv214/bin/python -m tests.zoo.compiled_paths                      # every model but resnet18
    PYTHONPATH=. .venv214/bin/python -m tests.zoo.compiled_paths --only mobilenet_v3_small,efficientnet_b0

``aot_eager`` builds the forward and backward graphs as inductor's are built and runs them as eager aten ops, so
the compiled step's loss and gradients should equal the eager step's exactly. Dropout is set to 0 first (the two
runs would draw different masks). After a calibration pass, one step with BatchNorm statistics training and one
with them frozen (observers frozen, fake-quant on); one line per model and engine: both losses, the relative L1
difference of all parameter gradients, frames compiled and graph breaks. resnet18 is CI's
(``tests/zoo/test_compiled_training.py``); this takes 1-3 minutes a model and engine on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from qlightning import Phase, get_engine
from qlightning.engines import Inputs, QuantSpec
from tests.zoo.harness import ENGINES, MODELS


def _without_dropout(net: torch.nn.Module) -> torch.nn.Module:
    for m in net.modules():
        if isinstance(m, torch.nn.Dropout) or type(m).__name__ in ("StochasticDepth", "DropPath"):
            m.p = 0.0
            if hasattr(m, "drop_prob"):
                m.drop_prob = 0.0
        for name in ("attention_dropout", "dropout"):  # transformers' attention modules keep plain floats
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)
    return net


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out if isinstance(out, torch.Tensor) else out[0], y)
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def check(name: str, engine_name: str) -> str:
    """One model through one engine's compiled path; a line saying what happened."""
    spec = MODELS[name]
    torch.manual_seed(0)
    x = torch.randint(0, 17, (16, 64)) if spec.inputs == "tokens" else torch.rand(16, 3, 32, 32)
    y = torch.randint(0, 10, (16,))
    engine = get_engine(engine_name)
    try:
        prepared = engine.prepare(_without_dropout(spec.build().train()), Inputs((x[:4],)), QuantSpec(backend="x86"))
    except Exception as exc:  # a KNOWN refusal (tests/zoo/harness.py) shows here as such
        return f"{name} {engine_name}: prepare refused: {type(exc).__name__}: {str(exc)[:120]}"
    engine.set_phase(prepared, Phase(True, True, False))
    with torch.no_grad():
        prepared.train()(x)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    started = time.perf_counter()
    rows = []
    try:
        engine.compile_training(prepared, backend="aot_eager")
        eager = copy.deepcopy(prepared)  # a copy runs eagerly
        for phase in (Phase(True, False, False), Phase(True, False, True)):
            engine.set_phase(prepared, phase)
            engine.set_phase(eager, phase)
            (loss, grads), (eager_loss, eager_grads) = _step(prepared.train(), x, y), _step(eager.train(), x, y)
            diff = sum(float((g - e).abs().sum()) for g, e in zip(grads, eager_grads))
            rel = diff / sum(float(e.abs().sum()) for e in eager_grads)
            rows.append(f"{'BN frozen' if phase.bn_frozen else 'BN training'}: loss {loss:.5f} / {eager_loss:.5f}, "
                        f"gradients {rel:.1e}")
    except Exception as exc:
        return f"{name} {engine_name}: compiled step failed: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        engine.decompile(prepared)
    breaks = torch._dynamo.utils.counters["graph_break"]
    frames = torch._dynamo.utils.counters["frames"]
    return (f"{name} {engine_name}: {'; '.join(rows)}; {frames['ok']} of {frames['total']} frames compiled, "
            f"{sum(breaks.values())} graph breaks {list(breaks)[:2]}; {time.perf_counter() - started:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names (default: every model but resnet18)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.only.split(",") if args.only else [n for n in MODELS if n != "resnet18"]
    for name in names:
        for engine_name in ENGINES:
            print(check(name, engine_name), flush=True)


if __name__ == "__main__":
    main()
