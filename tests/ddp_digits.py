"""QAT on digits with a multi-process strategy (2 CPU processes, gloo); run by tests/test_ddp.py.

Lightning's ``ddp`` strategy re-launches ``sys.argv`` for rank 1, so this is a script rather
than a test function. Every rank writes what it holds to OUTDIR:

* ``save{E}_rank{R}.pt``: the state_dict of the prepared ``net`` when a checkpoint of epoch E is
  written (seen from a callback that runs after the QAT callback's ``on_save_checkpoint``);
* ``val{E}_rank{R}.pt``: the state_dict of the prepared ``net`` after the first validation batch of
  epoch E (the model that validation measures);
* ``final_rank{R}.pt``: after fit, the converted int8 ``net`` state_dict, the fake-quant copy's
  state_dict, the int8 and fake-quant accuracies on the whole test split, ``trainer.test``'s
  accuracy, how many times this rank's engine converted, and the lowering choice (``ddp`` or one
  process; with ``ddp_spawn``/``ddp_fork`` the main process writes ``final_main.pt`` with the same
  model entries and the callback's state).

Usage::

    python tests/ddp_digits.py OUTDIR [--strategy ddp|ddp_spawn|ddp_fork] [--devices N] [--epochs N]
        [--no-sync] [--checkpoint] [--resume CKPT] [--no-broadcast-buffers] [--no-val] [--batch-size N]
        [--lowering fx|onnxruntime|...] [--engine fx|pt2e]
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import logging
import os
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel as DDP

import qlightning.callbacks.qat
from qlightning import QuantizationAwareTraining
from qlightning.examples import DigitsClassifier, DigitsDataModule

torch.set_num_threads(1)
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*does not have many workers.*")
warnings.filterwarnings("ignore", category=DeprecationWarning)


class Probe(Callback):
    """Records, on every rank, the state of the prepared ``net`` at checkpoint and validation time."""

    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir

    def _dump(self, trainer: pl.Trainer, pl_module: pl.LightningModule, name: str) -> None:
        state = {k: v.clone() for k, v in pl_module.net.state_dict().items()}  # parameters and buffers
        torch.save(state, self.outdir / f"{name}_rank{trainer.global_rank}.pt")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        # callbacks run in order, so this is after QuantizationAwareTraining.on_save_checkpoint
        self._dump(trainer, pl_module, f"save{trainer.current_epoch}")

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        # after the first validation forward: what validation measures (nothing moves in eval)
        if batch_idx == 0 and not trainer.sanity_checking:
            self._dump(trainer, pl_module, f"val{trainer.current_epoch}")


class ExitProbeDigits(DigitsDataModule):
    """Digits; every process that joined a process group writes ``exit_{pid}.txt`` as it exits.

    The file says whether the default process group was still initialised when interpreter
    finalization began. The handler is registered in the datamodule's ``setup``, which Lightning
    calls before the callbacks' ``setup``; ``atexit`` runs handlers last in, first out, so it runs
    after whatever the callbacks registered.
    """

    def __init__(self, outdir: Path, **kwargs) -> None:
        super().__init__(**kwargs)
        self.outdir = outdir
        self._probing = False

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not self._probing and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._probing = True
            rank, path = torch.distributed.get_rank(), self.outdir / f"exit_{os.getpid()}.txt"
            atexit.register(lambda: path.write_text(f"rank={rank} stage={getattr(stage, 'value', stage)} initialized={torch.distributed.is_initialized()}"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--no-sync", action="store_true", help="disable the callback's buffer broadcast")
    parser.add_argument("--checkpoint", action="store_true", help="save a checkpoint every epoch")
    parser.add_argument("--resume", default=None, help="checkpoint to resume from")
    parser.add_argument("--no-broadcast-buffers", action="store_true", help="DDP without its buffer broadcast")
    parser.add_argument("--no-val", action="store_true", help="no validation loop")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2, help="1: one process, no distributed strategy")
    parser.add_argument("--lowering", default="fx")
    parser.add_argument("--engine", default="fx")
    args = parser.parse_args()
    args.outdir.mkdir(parents=True, exist_ok=True)

    if args.no_sync:  # what the callback would do without qlightning.callbacks.distributed
        qlightning.callbacks.qat.broadcast_buffers = lambda trainer, modules, src=0: 0

    pl.seed_everything(0, verbose=False)
    dm = ExitProbeDigits(args.outdir, batch_size=args.batch_size, seed=0)
    model = DigitsClassifier()
    freeze = max(1, min(3, args.epochs - 1))  # a milestone the fit never reaches is a config error
    qat = QuantizationAwareTraining(
        modules=["net"], fake_quant_start={"epoch": 1}, observer_freeze={"epoch": freeze}, bn_freeze={"epoch": freeze},
        lowering=args.lowering, engine=args.engine,
    )
    convert_calls = []  # how many times this process's engine converted (rank 0 only under DDP)
    engine_convert = qat.engine.convert
    if args.strategy == "ddp":

        def counting_convert(*a, **k):
            convert_calls.append(1)
            return engine_convert(*a, **k)

        qat.engine.convert = counting_convert
    callbacks: list[Callback] = [qat]
    if args.strategy == "ddp":  # ddp_spawn pickles the callbacks into each process: keep them simple
        callbacks.append(Probe(args.outdir))
    if args.checkpoint:
        callbacks.append(
            ModelCheckpoint(dirpath=args.outdir / "ckpt", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
        )
    strategy = args.strategy
    if args.no_broadcast_buffers:
        # torch 2.13 renamed broadcast_buffers (deprecated) to forward_sync_buffers
        renamed = "forward_sync_buffers" in inspect.signature(DDP).parameters
        key = "forward_sync_buffers" if renamed else "broadcast_buffers"
        strategy = DDPStrategy(start_method="spawn" if strategy == "ddp_spawn" else "popen", **{key: False})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        limit_val_batches=0 if args.no_val else 2,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=args.checkpoint,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=args.resume)

    dm.setup()
    x, y = dm.splits["test"].tensors

    def accuracy(net: torch.nn.Module) -> float:
        with torch.no_grad():
            return (net.eval()(x).argmax(1) == y).float().mean().item()

    if args.strategy != "ddp" and args.devices > 1:
        # ddp_spawn/ddp_fork: this is the main process again, its model updated from rank 0's final state_dict
        torch.save(
            {
                "converted": qat.converted,
                "prepared": qat.prepared,
                "targets": qat.targets,
                "phase": None if qat.phase is None else vars(qat.phase),
                "int8_modules": sorted(qat.int8_modules),
                "int8_is_in_model": qat.int8_modules.get("net") is model.net,
                "lowering_choices": {k: v["name"] for k, v in qat.lowering_choices.items()},
                "provenance": qat.provenance,
                "net": model.net.state_dict(),
                "accuracy": accuracy(model.net),
                "fake_quant": qat.fake_quant_modules["net"].state_dict() if "net" in qat.fake_quant_modules else None,
                "fake_quant_accuracy": accuracy(qat.fake_quant_modules["net"]) if "net" in qat.fake_quant_modules else None,
                # the same Trainer starts new processes with the main process's (int8) model
                "test_accuracy": trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"],
            },
            args.outdir / "final_main.pt",
        )
        return
    result = {
        "converted": qat.converted,
        "convert_calls": len(convert_calls),
        "lowering_choices": {k: v["name"] for k, v in qat.lowering_choices.items()},
        "phase": None if qat.phase is None else vars(qat.phase),
        "engine_int8": qat.int8_modules["net"].state_dict(),
        "world_size": trainer.world_size,
        "int8": model.net.state_dict(),
        "fake_quant": qat.fake_quant_modules["net"].state_dict(),
        "int8_accuracy": accuracy(model.net),
        "fake_quant_accuracy": accuracy(qat.fake_quant_modules["net"]),
        "test_accuracy": trainer.test(model, datamodule=dm, verbose=False)[0]["test/accuracy"],
    }
    torch.save(result, args.outdir / f"final_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
