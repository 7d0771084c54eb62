"""quant.lowering wiring: the callback keeps the runtime choose_lowering picks and records the choice."""

from __future__ import annotations

import pytest
import torch

from qlightning import QuantizationAwareTraining
from qlightning.core.metrics import sqnr_db, top1_agreement
from qlightning.core.session import PARITY_CALLS
from qlightning.errors import ConfigError
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.quantize.lowering import source_of

from conftest import make_trainer, test_accuracy


def test_bad_lowering_arguments_fail_at_construction():
    with pytest.raises(ConfigError) as err:
        QuantizationAwareTraining(lowering="tensorrt", lowering_candidates=["tpu"], lowering_batch_size=0)
    text = str(err.value)
    assert "lowering='tensorrt'" in text and "tpu" in text and "lowering_batch_size" in text
    with pytest.raises(ConfigError, match="keep_fake_quant"):
        QuantizationAwareTraining(lowering="auto", keep_fake_quant=False)


def test_lowering_auto_keeps_a_faithful_runtime_and_records_it():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(
        modules=["net"], lowering="auto", lowering_candidates=["fx", "onnxruntime"], lowering_batch_size=16,
        fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2},
    )
    make_trainer([qat], max_epochs=3).fit(model, datamodule=dm)
    choice = qat.lowering_choices["net"]
    assert choice["name"] in ("fx", "onnxruntime") and choice["name"] in choice["passed"]
    assert set(choice["latency_ms"]) == {"fx", "onnxruntime"}
    assert choice["batch_size"] == 16
    assert source_of(model.net) is qat.int8_modules["net"]
    fake_quant_acc = test_accuracy(qat.fake_quant_modules["net"], dm)
    assert abs(test_accuracy(model.net, dm) - fake_quant_acc) <= 0.01

    # the parity that decided was measured on validation rows in batches of 16, not on the example
    # input (zeros: every row the same, so top-1 agreement would be all or nothing)
    dm.setup("fit")
    x = torch.cat([x for x, _ in list(dm.val_dataloader())[:4]])
    x = x[: min(len(x) // 16, PARITY_CALLS) * 16]
    assert choice["top1_rows"]["fx"] == len(x) >= 64 and "validation batches" in choice["parity_on"]
    with torch.no_grad():
        reference = torch.cat([qat.fake_quant_modules["net"](b) for b in x.split(16)])
        int8 = torch.cat([qat.int8_modules["net"](b) for b in x.split(16)])
    assert reference.argmax(1).unique().numel() == 10
    assert choice["sqnr_db"]["fx"] == pytest.approx(sqnr_db(reference, int8), abs=0.01)
    assert choice["top1_agreement"]["fx"] == pytest.approx(top1_agreement(reference, int8), abs=1e-4)


def test_lowering_fx_is_the_default_and_changes_nothing(trained_qat):
    _, model, _, qat = trained_qat
    assert qat.lowering == "fx" and qat.lowering_choices == {}
    assert model.net is qat.int8_modules["net"]


@pytest.mark.slow
def test_pt2e_lowered_by_inductor_through_the_callback():
    """quant.engine=pt2e quant.lowering=inductor: the compiled q/dq graph replaces the module; compile time is apart."""
    pytest.importorskip("torchao.quantization.pt2e")
    from qlightning.quantize.lowering import InductorModule

    torch.manual_seed(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(
        modules=["net"], engine="pt2e", lowering="inductor",
        fake_quant_start={"epoch": 1}, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2},
    )
    make_trainer([qat], max_epochs=3).fit(model, datamodule=dm)
    choice = qat.lowering_choices["net"]
    assert set(choice["latency_ms"]) == {"fx", "inductor"} and "inductor" in choice["passed"], choice["errors"]
    assert choice["sqnr_db"]["inductor"] >= 25.0
    assert set(choice["first_call_s"]) == {"fx", "inductor"}  # inductor's compilation, apart from latency_ms
    assert choice["compiled_with"] == {"inductor": "cpp wrapper"}  # report.json says how its kernels are called
    assert source_of(model.net) is qat.int8_modules["net"]
    if choice["name"] == "inductor":
        assert isinstance(model.net, InductorModule)
    fake_quant_acc = test_accuracy(qat.fake_quant_modules["net"], dm)
    assert abs(test_accuracy(model.net, dm) - fake_quant_acc) <= 0.01  # the whole test split: another batch size
