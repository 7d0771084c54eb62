"""`train(cfg)`: the whole job as a pure function of a composed config and a run directory."""

from __future__ import annotations

import importlib.util
import json
import pickle
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, Logger
from omegaconf import DictConfig, OmegaConf

from qlightning.callbacks.checkpoint import AtomicCheckpointIO, ModelCheckpointWithFinalLast
from qlightning.callbacks.distributed import broadcast_object, local_metrics
from qlightning.config.build import config_keys, instantiate_checked
from qlightning.config.schema import sections
from qlightning.config.validate import validate_config
from qlightning.core.inputs import source_of
from qlightning.core.quiet import quiet
from qlightning.run import report as reporting
from qlightning.run.artifacts import finalize_run
from qlightning.run.export import save_int8
from qlightning.run.report import evaluation_trainer
from qlightning.run.summary import log_report, print_summary
from qlightning.errors import ConfigError, QLightningError


def trainer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The Trainer's keyword arguments from ``cfg.trainer`` (unset keys left to Lightning).

    Args:
        cfg: the composed run config.
    """
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.trainer, resolve=True).items() if v is not None}
    return kwargs


def tensorboard_available() -> bool:
    """Lightning's TensorBoardLogger writes with ``tensorboard`` or ``tensorboardX``."""
    return any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))


def build_loggers(cfg: DictConfig, run_dir: Path) -> list[Logger]:
    """The run's Lightning loggers, all writing under ``run_dir/logs``; a missing package is a ConfigError.

    Args:
        cfg: the composed run config (its ``logger`` section).
        run_dir: the run's folder.
    """
    names = [getattr(n, "value", n) for n in cfg.get("loggers", ["csv"])]
    loggers: list[Logger] = []
    for name in dict.fromkeys(names):
        if name == "csv":
            loggers.append(CSVLogger(str(run_dir), name="logs", version=""))
        elif name == "tensorboard":
            if not tensorboard_available():
                raise ConfigError(
                    "loggers=[tensorboard]: the tensorboard package is not installed; "
                    "pip install 'qlightning[tensorboard]', or use loggers=[csv]"
                )
            from lightning.pytorch.loggers import TensorBoardLogger

            loggers.append(TensorBoardLogger(str(run_dir), name="logs", version="tensorboard", default_hp_metric=False))
    return loggers


def train(cfg: DictConfig, run_dir: Path, provenance: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train with QAT, convert to int8, and write checkpoints, the int8 model and the report into ``run_dir``.

    Every configuration problem is raised as one :class:`ConfigError` before the first training step.

    Args:
        cfg: the composed, checked run config.
        run_dir: the run's folder.
        provenance: what made the run (command, recipe, versions), kept in checkpoints and the report.
    """
    start = time.perf_counter()
    run_dir = Path(run_dir)
    errors, callback, _ = validate_config(cfg, dry_run=None)  # the dry run where it costs seconds (fx)
    if errors:
        raise ConfigError(errors)

    callback.provenance = {**(provenance or {}), "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = instantiate_checked(cfg.data, "data")
    model = instantiate_checked(cfg.model, "model")

    # last.ckpt is also written when training ends: with every_n_train_steps it would otherwise hold
    # the last multiple of N steps, not the weights that were converted and reported
    ckpt = ModelCheckpointWithFinalLast(
        dirpath=run_dir / "checkpoints",
        filename="{epoch}-{step}",
        save_last=cfg.checkpoint.save_last,
        save_top_k=cfg.checkpoint.save_top_k,
        every_n_epochs=cfg.checkpoint.every_n_epochs if cfg.checkpoint.every_n_train_steps is None else None,
        every_n_train_steps=cfg.checkpoint.every_n_train_steps,
    )
    loggers = build_loggers(cfg, run_dir)
    trainer = pl.Trainer(
        **trainer_kwargs(cfg),
        default_root_dir=str(run_dir),
        callbacks=[callback, ckpt],
        plugins=[AtomicCheckpointIO()],  # a killed run leaves whole checkpoints only
        logger=loggers or False,
    )
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except ConfigError as exc:  # raised by the callback before the first step: say it in config keys
        raise ConfigError([config_keys(p) for p in exc.problems]) from None

    result: dict[str, Any] = {"run_dir": str(run_dir), "provenance": provenance or {}}
    # Exports, the report and the parity gate run once, on global rank 0, while the other ranks wait
    # for rank 0's outcome (through the strategy's broadcast, so they cannot leave early or hang).
    outcome: Optional[dict[str, Any]] = None
    if trainer.is_global_zero:
        try:
            with local_metrics(model):  # rank 0 alone evaluates: no all_gather towards the waiting ranks
                outcome = {"result": _export_and_report(cfg, callback, model, datamodule, run_dir, result)}
        except BaseException as exc:
            broadcast_object(trainer, {"error": f"{type(exc).__name__}: {exc}"})
            raise
    outcome = broadcast_object(trainer, outcome)
    if "error" in outcome:
        raise QLightningError(f"rank 0 failed after training: {outcome['error']}")
    result = outcome["result"]
    result["checkpoint"] = ckpt.last_model_path or ckpt.best_model_path
    result["wall_s"] = round(time.perf_counter() - start, 2)
    if trainer.is_global_zero:  # every rank returns the same result; one writes it
        if "metrics" in result:
            reporting.write(result, run_dir)
            log_report(trainer.loggers, result, step=trainer.global_step)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        if provenance:
            (run_dir / "provenance.json").write_text(json.dumps(provenance, indent=2))
        if "metrics" in result:
            reporting.print_table(result)
        print_summary(result, run_dir)
    return result


def _export_and_report(
    cfg: DictConfig, callback: Any, model: pl.LightningModule, datamodule: Any, run_dir: Path, result: dict[str, Any]
) -> dict[str, Any]:
    """Global rank 0: the TorchScript int8 models, the report and the run's artifacts (exports, parity gate)."""
    if not callback.converted:
        return result
    result["int8_models"] = {}
    for name in callback.targets:
        path = run_dir / f"int8_{name}.pt"
        problem = save_int8(source_of(model.get_submodule(name)), path, callback.inputs[name])
        result["int8_models"][name] = str(path) if problem is None else f"not saved: {problem}"
    if cfg.report.enabled:

        def eval_trainer() -> pl.Trainer:
            return evaluation_trainer(cfg.trainer.limit_test_batches)

        with quiet(messages=(".*does not have many workers.*",)):
            result.update(
                reporting.build_report(
                    callback,
                    model,
                    datamodule,
                    eval_trainer,
                    batch_size=cfg.report.latency_batch_size,
                    repeats=cfg.report.latency_repeats,
                    threads=cfg.report.latency_threads,
                )
            )
    result.update(finalize_run(callback, model, datamodule, sections(cfg), run_dir, result))
    pickle.dumps(result)  # it goes to the other ranks: fail here (and tell them) rather than in the broadcast
    return result
