"""Quick checks of what lets ddp_spawn / ddp_fork / DDP carry converted models between processes.

The multi-process runs themselves are in tests/test_ddp.py (slow).
"""

from __future__ import annotations


import lightning.pytorch as pl
import pytest
import torch

from qlightning import QuantizationAwareTraining
from qlightning.callbacks.distributed import dumps_modules, loads_modules
from qlightning.engines import Inputs
from qlightning.errors import ConfigError, QLightningError
from qlightning.examples import DigitsClassifier


def _converted_digits() -> tuple[DigitsClassifier, QuantizationAwareTraining]:
    torch.manual_seed(0)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"], example_inputs={"net": torch.randn(4, 1, 8, 8)})
    qat.prepare(model)
    qat._set_observers(model, True)
    model.net.train()
    model.net(torch.rand(32, 1, 8, 8))
    qat.convert(model)
    return model, qat


def test_fx_int8_model_survives_the_transport_between_processes():
    model, _ = _converted_digits()
    annotations = [node.type for node in model.net.graph.nodes]
    copy = loads_modules(dumps_modules({"net": model.net}))["net"]
    x = torch.rand(16, 1, 8, 8)
    assert torch.equal(copy(x), model.net(x))
    a, b = copy.state_dict(), model.net.state_dict()
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor) and value.is_quantized:
            assert torch.equal(value.int_repr(), b[key].int_repr()) and torch.equal(value.dequantize(), b[key].dequantize())
    # the transported copy drops string annotations; the model itself keeps them
    assert [node.type for node in model.net.graph.nodes] == annotations


def test_main_process_rebuilds_rank_zeros_fake_quant_and_int8_models():
    """What the main process makes of rank 0's payload (QAT._restore_in_main_process, here in one
    process): the int8 model unpickled, the fake-quant model prepared again (with the engine's fast
    training paths) and loaded strictly with rank 0's state."""
    from qlightning.engines.fx import fast_fq

    model, qat = _converted_digits()
    payload = qat._main_process_payload(model)
    main_model = DigitsClassifier()
    main_qat = QuantizationAwareTraining(modules=["net"], example_inputs={"net": torch.randn(4, 1, 8, 8)})
    main_qat._restore_in_main_process(main_model, payload)
    x = torch.rand(16, 1, 8, 8)
    assert main_qat.converted and main_qat.targets == ["net"]
    assert torch.equal(main_model.net(x), model.net(x))
    fake_quant, rebuilt = qat.fake_quant_modules["net"], main_qat.fake_quant_modules["net"]
    a, b = fake_quant.state_dict(), rebuilt.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), fake_quant(x))
    assert any(fast_fq.is_fast(m) for m in rebuilt.modules())


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_pt2e_with_a_spawn_strategy_is_refused_naming_strategy(strategy):
    pytest.importorskip("torchao")
    qat = QuantizationAwareTraining(modules=["net"], engine="pt2e")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match=r"strategy='ddp_.*engine='pt2e'.*valid choices: strategy='ddp'"):
        qat.setup(trainer, DigitsClassifier(), "fit")


def test_main_process_refuses_a_spawn_fit_that_sent_no_qat_state():
    """No silent float model: a finished spawn fit whose rank 0 sent nothing back is an error."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

    qat = QuantizationAwareTraining(modules=["net"])
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", callbacks=[qat], logger=False)
    trainer.strategy._lightning_module = DigitsClassifier()
    output = _WorkerOutput(None, "/nonexistent/.temp.ckpt", trainer.state, None, {"callback_metrics_bytes": b""})
    with pytest.raises(QLightningError, match="did not send its QAT state"):
        trainer.strategy.launcher._recover_results_in_main_process(output, trainer)
    assert isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
