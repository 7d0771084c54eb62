"""What trains is what deploys (issue 14, items 4 and 5): int8 vs fake-quant fidelity, and evaluation
stages that leave every quantization buffer bit-identical. Real digits training through the callback."""

from __future__ import annotations

import importlib.util

import lightning.pytorch as pl
import pytest
import torch

from qlightning import QuantizationAwareTraining
from qlightning.examples import DigitsClassifier, DigitsDataModule
from qlightning.core.metrics import sqnr_db, top1_agreement

from conftest import DEFAULT_SCHEDULE, make_trainer

ENGINES = ["fx", pytest.param("pt2e", marks=pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="torchao not installed"))]


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().numpy().tobytes()  # bit-identity (NaN == NaN, -0.0 != 0.0)


def _assert_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], stage: str) -> None:
    assert before.keys() == after.keys(), f"{stage}: buffers added/removed: {before.keys() ^ after.keys()}"
    moved = [
        f"{name}: {tuple(before[name].shape)} -> {tuple(after[name].shape)}"
        + ("" if before[name].shape != after[name].shape else f" (e.g. {before[name].flatten()[:3].tolist()} -> {after[name].flatten()[:3].tolist()})")
        for name in before
        if before[name].shape != after[name].shape or before[name].dtype != after[name].dtype
        or _bytes(before[name]) != _bytes(after[name])
    ]
    assert not moved, f"{stage} moved {len(moved)} buffer(s): {moved[:6]}"


class _Snapshot(pl.Callback):
    """Buffers of ``pl_module.net`` just before and just after the sanity check (after preparation)."""

    def __init__(self) -> None:
        self.before: dict[str, torch.Tensor] | None = None
        self.after: dict[str, torch.Tensor] | None = None

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self.before = _buffers(pl_module.net)

    def on_sanity_check_end(self, trainer, pl_module) -> None:
        self.after = _buffers(pl_module.net)


@pytest.mark.parametrize("fake_quant_start", [{"epoch": 1}, None], ids=["float_warmup", "fake_quant_from_start"])
@pytest.mark.parametrize("engine", ENGINES)
def test_evaluation_stages_leave_every_buffer_bit_identical(engine, fake_quant_start):
    """Sanity check, validate, test and predict: every buffer of the prepared module unchanged, bit for bit.

    Before the fix the sanity check (fake-quant enabled by default, nothing observed yet) made the fused
    op size and write per-channel scale / zero_point / min_val / max_val and set scales 1.0 -> 0.1.
    """
    pl.seed_everything(0)
    dm = DigitsDataModule(seed=0)
    model = DigitsClassifier()
    snap = _Snapshot()
    # short schedule: fake-quant from epoch 1 (or from the start: the sanity check then fake-quantizes with
    # nothing observed), observers frozen from epoch 2, 3 epochs of 8 batches (a few seconds)
    qat = QuantizationAwareTraining(
        modules=["net"], backend="x86", engine=engine, convert_on_fit_end=False,
        fake_quant_start=fake_quant_start, observer_freeze={"epoch": 2}, bn_freeze={"epoch": 2},
    )
    trainer = make_trainer([qat, snap], max_epochs=3, num_sanity_val_steps=2, limit_train_batches=8)
    trainer.fit(model, datamodule=dm)
    assert snap.before is not None and snap.after is not None
    _assert_identical(snap.before, snap.after, "sanity check")
    for stage in ("validate", "test", "predict"):
        before = _buffers(model.net)
        getattr(trainer, stage)(model, datamodule=dm, verbose=False) if stage != "predict" else trainer.predict(model, datamodule=dm)
        _assert_identical(before, _buffers(model.net), f"trainer.{stage}")


def _default_job(engine: str, seed: int = 0, fidelity: object = True, qconfig_mapping: object = None, **options):
    """The embedded default job (digits CNN, x86, fake-quant from epoch 3, freeze at 6, 8 epochs)."""
    pl.seed_everything(seed)
    dm = DigitsDataModule(seed=seed)
    model = DigitsClassifier()
    qat = QuantizationAwareTraining(modules=["net"], backend="x86", engine=engine, engine_options=options,
                                    fidelity=fidelity, qconfig_mapping=qconfig_mapping, **DEFAULT_SCHEDULE)
    make_trainer([qat]).fit(model, datamodule=dm)
    dm.setup()
    x, y = dm.splits["test"].tensors
    with torch.no_grad():
        fake_quant, int8 = qat.fake_quant_modules["net"](x), model.net(x)
    return fake_quant, int8, y


@pytest.mark.slow  # 8-epoch default job: ~10 s alone, 40-60 s on a shared 2-core machine
@pytest.mark.parametrize("engine", ENGINES)
def test_int8_computes_what_fake_quant_trained(engine):
    """int8 vs fake-quant logits on the digits test set after the default job: >= 30 dB, >= 99.5 % top-1.

    FX before the fix: 15.7 dB (x86's reduce_range fake-quant clipped at 127 what int8 kept up to 255,
    and convert re-derived every per-channel weight scale 1/255 off the trained one); now ~50 dB.
    PT2E: ~40 dB before and after.
    """
    fake_quant, int8, y = _default_job(engine)
    sqnr, agreement = sqnr_db(fake_quant, int8), top1_agreement(fake_quant, int8)
    assert sqnr >= 30, f"{engine}: int8 vs fake-quant logits {sqnr:.1f} dB"
    assert agreement >= 0.995, f"{engine}: top-1 agreement {agreement:.4f}"
    # today's accuracy on this seed (99.26 % FX, 98.89 % PT2E): int8 is not worse than it was. FX was 99.63 % before
    # the pools observed their own grid (stop 34): one image of 270; over seeds 0-11 the two are 98.98 % and 98.95 %
    # (one image in 3240), int8 equal to fake-quant on every seed (/tmp script, _default_job(pool_observers=...))
    assert (int8.argmax(1) == y).float().mean().item() >= (0.992 if engine == "fx" else 0.988)


@pytest.mark.slow  # as above
def test_fx_clamp_and_trained_qparams_are_what_close_the_gap():
    """Without the two convert fixes the FX gap is back (the test above is not passing by luck).

    Measured with torch.ao's own default QAT mapping (weight ranges averaged over steps), where the gap was
    found: the default mapping's current weight ranges (notes/defaults.md) leave less between the trained and
    the re-derived weight scales, so there the gap without the fixes is smaller (not a reason to drop them)."""
    from torch.ao.quantization import get_default_qat_qconfig_mapping

    # the callback's fit-end fidelity gate would refuse this int8 model: warn, so that it is measured here
    fake_quant, int8, _ = _default_job("fx", fidelity={"on_breach": "warn"}, qconfig_mapping=get_default_qat_qconfig_mapping("x86"),
                                       clamp_activations=False, trained_qparams=False)
    assert sqnr_db(fake_quant, int8) < 20
