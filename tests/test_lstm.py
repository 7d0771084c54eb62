"""An LSTM sequence classifier on digits rows, quantized through `Trainer.fit`: static (custom module pair) and dynamic."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.ao.nn.quantizable as nnqa
import torch.ao.nn.quantized as nnq
import torch.ao.nn.quantized.dynamic as nnqd

from conftest import make_trainer, test_accuracy
from qlightning import QuantizationAwareTraining
from qlightning.examples import DigitsDataModule
from qlightning.examples.lstm import LSTM_DYNAMIC, LSTM_STATIC, LSTMClassifier

SHORT = dict(fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2})

def _through_clamps(node):
    """The node behind the FX engine's clamps to the trained activation range (quantized::clamp)."""
    while node.meta.get("qlightning_activation_clamp") and node.args:
        node = node.args[0]
    return node



@pytest.fixture(autouse=True)
def seeded():
    """Models are built before `fit` seeds: seed first, so no test depends on the ones before it."""
    pl.seed_everything(0, verbose=False)


def run(config: dict, epochs: int = 3, batches: int = 12):
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0, as_sequence=True)
    model = LSTMClassifier(hidden_size=32)
    qat = QuantizationAwareTraining(modules=["net"], **SHORT, **config)
    trainer = make_trainer([qat], max_epochs=epochs, limit_train_batches=batches, limit_val_batches=2)
    trainer.fit(model, datamodule=dm)
    return trainer, model, dm, qat


def test_static_lstm_through_the_quantizable_lstm_custom_module_pair():
    # the quantized LSTM departs from its quantizable (fake-quant) twin: the gate must say so, loudly
    with pytest.warns(UserWarning, match="int8 model departs from the fake-quant model"):
        trainer, model, dm, qat = run({**LSTM_STATIC, "fidelity": {"on_breach": "warn", "min_sqnr_db": 25.0}})
    assert not qat.fidelity_results["net"]["passed"] and qat.fidelity_results["net"]["action"] == "kept int8 (on_breach=warn)"
    assert type(qat.fake_quant_modules["net"].lstm) is nnqa.LSTM  # observed during QAT
    lstm = model.net.lstm
    assert type(lstm) is nnq.LSTM
    assert isinstance(lstm.layers[0].layer_fw.cell.igates, nnq.Linear)  # int8 gates
    (call,) = [n for n in model.net.graph.nodes if n.op == "call_module" and n.target == "lstm"]
    assert _through_clamps(call.args[0]).target == torch.quantize_per_tensor  # int8 input
    assert isinstance(model.net.head, nnq.Linear)
    int8_acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    fq_acc = test_accuracy(qat.fake_quant_modules["net"], dm)
    assert int8_acc >= fq_acc - 0.05 and int8_acc > 0.4, (int8_acc, fq_acc)


def test_dynamic_lstm():
    trainer, model, dm, qat = run(LSTM_DYNAMIC)
    assert type(model.net.lstm) is nnqd.LSTM
    assert isinstance(model.net.head, nnq.Linear)  # the head is static int8, trained with fake-quant
    int8_acc = trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"]
    fq_acc = test_accuracy(qat.fake_quant_modules["net"], dm)
    assert int8_acc >= fq_acc - 0.05 and int8_acc > 0.4, (int8_acc, fq_acc)


def test_lstm_called_without_its_hidden_state_is_flagged_by_the_doctor():
    from torch import nn

    from qlightning.quantize.doctor import diagnose

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 10)

        def forward(self, rows: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(rows)
            return self.head(out[:, -1])

    report = diagnose(Plain())
    assert any("(h0, c0)" in note for note in report.get("").notes)
    assert not any("(h0, c0)" in note for f in diagnose(LSTMClassifier()).findings for note in f.notes)


@pytest.mark.parametrize("recipe", ["lstm_static", "lstm_dynamic"])
def test_lstm_recipes_validate(recipe):
    from qlightning.cli.recipes import validate

    assert validate(recipe) == []
