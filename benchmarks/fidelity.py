"""Where the int8 model and the fake-quant model it was trained as part: per-layer SQNR on digits.

Trains the digits job (default schedule: fake-quant from epoch 3, observer / BN freeze at 6, 8 epochs)
through :class:`~qlightning.QuantizationAwareTraining`, then runs the kept fake-quant module and the
converted int8 module (both eval) on the digits test split and prints:

* output SQNR (int8 vs fake-quant logits) and top-1 agreement, fake-quant and int8 accuracy;
* per layer (FX engine): SQNR of each layer's (re)quantized output, int8 vs fake-quant.

Usage::

    python -m benchmarks.fidelity                                  # FX, digits CNN
    python -m benchmarks.fidelity --engine pt2e
    python -m benchmarks.fidelity --model resnet --seeds 0 1 2
    python -m benchmarks.fidelity --option fast_qat=false          # engine_options
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import warnings

import torch


def _value(text: str):
    return {"true": True, "false": False}.get(text.lower(), text)


def build(model: str):
    from qlightning.examples import DigitsClassifier
    from qlightning.examples.digits import ClassifierModule

    if model == "cnn":
        return DigitsClassifier()
    from benchmarks.models import ResNet18Like

    m = ClassifierModule(ResNet18Like(width=8, in_channels=1), lr=1e-2)
    m.example_input_array = torch.zeros(1, 1, 8, 8)
    return m


def run(engine: str = "fx", model: str = "cnn", seed: int = 0, options: dict | None = None, epochs: int = 8,
        per_layer: bool = True) -> dict:
    import lightning.pytorch as pl

    from qlightning import QuantizationAwareTraining
    from qlightning.examples import DigitsDataModule
    from qlightning.core.fidelity import per_layer_sqnr
    from qlightning.core.metrics import sqnr_db, top1_agreement

    pl.seed_everything(seed)
    dm = DigitsDataModule(seed=seed)
    net = build(model)
    qat = QuantizationAwareTraining(
        modules=["net"], backend="x86", engine=engine, engine_options=options or {},
        fake_quant_start={"epoch": 3}, observer_freeze={"epoch": 6}, bn_freeze={"epoch": 6},
    )
    trainer = pl.Trainer(max_epochs=epochs, callbacks=[qat], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    start = time.perf_counter()
    trainer.fit(net, datamodule=dm)
    fit_s = time.perf_counter() - start
    dm.setup()
    x, y = dm.splits["test"].tensors
    fq, int8 = qat.fake_quant_modules["net"], net.net
    with torch.no_grad():
        a, b = fq(x), int8(x)
    out = {
        "engine": engine, "model": model, "seed": seed, "options": options or {}, "fit_s": round(fit_s, 1),
        "sqnr_db": round(sqnr_db(a, b), 2), "top1_agreement": round(top1_agreement(a, b), 4),
        "fake_quant_acc": round((a.argmax(1) == y).float().mean().item(), 4),
        "int8_acc": round((b.argmax(1) == y).float().mean().item(), 4),
    }
    if per_layer and isinstance(int8, torch.fx.GraphModule):
        rows = per_layer_sqnr("", {"fake_quant": fq, "int8": int8}, [(x,)], pairs=(("db", "int8", "fake_quant"),))
        out["layers"] = {r["layer"]: r["db"] for r in rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="fx")
    parser.add_argument("--model", default="cnn", choices=["cnn", "resnet"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--option", action="append", default=[], help="engine option NAME=VALUE")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    options = {k: _value(v) for k, v in (o.split("=", 1) for o in args.option)}
    for seed in args.seeds:
        res = run(args.engine, args.model, seed, options, args.epochs)
        if args.json:
            print(json.dumps(res))
            continue
        layers = res.pop("layers", {})
        print(" ".join(f"{k}={v}" for k, v in res.items()))
        for name, db in layers.items():
            print(f"    {name:40s} {db:8.2f} dB")


if __name__ == "__main__":
    main()
