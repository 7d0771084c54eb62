"""The compiled QAT training path (``engine_options.compile``) on a real model: torchvision's resnet18 (BasicBlock
calls one ``nn.ReLU`` at two sites; residual adds) through both engines.

Traced through ``torch.compile`` with the ``aot_eager`` backend (dynamo and AOT autograd build the forward and
backward graphs, which run as eager aten ops: no inductor code generation, whose cost on 2 cores is the digits
tests' business, ``tests/test_compiled_qat.py``): one graph a phase, no graph break, and the same loss and gradients
as the same module run eagerly in every phase. While BatchNorm statistics train, the compiled backward of the conv-bn
fold read the running variance as the training batch_norm had left it (parameter gradients 20 % off at resnet18's
first step, notes/perf.md section 34); the folds read a snapshot now (``traceable.folded_variance``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from qlightning import Phase, get_engine
from qlightning.engines import Inputs, QuantSpec
from tests.zoo.harness import ENGINES, MODELS, have

pytestmark = pytest.mark.slow


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("engine_name", ENGINES)
def test_resnet18_compiled_training_traces_whole_and_computes_the_eager_step(engine_name: str) -> None:
    if not have("torchvision"):
        pytest.skip(f"needs torchvision, not importable beside torch {torch.__version__} (the zoo runs in .venv214)")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    engine = get_engine(engine_name)
    x, y = torch.rand(16, 3, 32, 32), torch.randint(0, 10, (16,))
    prepared = engine.prepare(MODELS["resnet18"].build().train(), Inputs((x[:4],)), QuantSpec(backend="x86"))
    engine.set_phase(prepared, Phase(True, True, False))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert engine.compile_training(prepared, backend="aot_eager")
    eager = copy.deepcopy(prepared)  # a copy runs eagerly, through the same traceable fake-quants
    for phase in (Phase(True, True, False), Phase(True, True, True), Phase(True, False, True)):
        engine.set_phase(prepared, phase)
        engine.set_phase(eager, phase)
        (loss, grads), (eager_loss, eager_grads) = _step(prepared.train(), x, y), _step(eager.train(), x, y)
        assert loss == pytest.approx(eager_loss, rel=1e-5), phase
        assert len(grads) == len(eager_grads)
        worst = max(float((g - e).abs().max() / e.abs().max().clamp(min=1e-12)) for g, e in zip(grads, eager_grads))
        assert worst < 1e-3, (phase, worst)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert torch._dynamo.utils.counters["frames"]["ok"] == 3, dict(torch._dynamo.utils.counters["frames"])
    state, eager_state = prepared.state_dict(), eager.state_dict()
    assert [k for k in state if not torch.allclose(state[k].float(), eager_state[k].float(), rtol=1e-4, atol=1e-6)] == []
    engine.decompile(prepared)
    torch._dynamo.reset()
