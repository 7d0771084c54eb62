"""QuantizationAwareTraining: prepare at fit start, follow the schedule, convert at fit end."""

from __future__ import annotations

import copy
import io
import os
import shutil
import tempfile
from typing import Any, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelPruning
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn.utils import prune
from typing_extensions import override

from qlightning.capture import example_inputs_for, resolve_targets
from qlightning.distributed import (
    broadcast_buffers,
    broadcast_object,
    dumps_modules,
    is_distributed,
    loads_modules,
    pickle_whole_for_new_processes,
)
from qlightning.engines import BACKENDS, ENGINES, Inputs, QuantEngine, QuantSpec, check_engine_options, get_engine
from qlightning.errors import ConfigError, EngineUnavailableError, QLightningError
from qlightning.schedule import MilestoneLike, Phase, Schedule

STAGES = ("train", "validate", "test", "predict")
STATE_VERSION = 1


def check_common_arguments(modules: Any, backend: str, engine: Any, errors: list[str]) -> list[str]:
    """The checks QAT and PTQ callbacks share: module names, backend, engine. Returns the names."""
    names = [modules] if isinstance(modules, str) else list(modules)
    if not names or not all(isinstance(n, str) and n for n in names):
        errors.append(f"modules={modules!r}: give one or more submodule names, e.g. ['net']")
    if backend not in BACKENDS:
        errors.append(f"backend={backend!r}: unknown backend; valid choices: {list(BACKENDS)}")
    elif backend not in torch.backends.quantized.supported_engines:
        errors.append(
            f"backend={backend!r}: not available in this torch build; available: "
            f"{[b for b in BACKENDS if b in torch.backends.quantized.supported_engines]}"
        )
    if isinstance(engine, str) and engine not in ENGINES:
        errors.append(f"engine={engine!r}: unknown engine; valid choices: {list(ENGINES)}")
    return names


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.Sequential, nn.ModuleList)) and child.isdigit():
        parent[int(child)] = module
    else:
        setattr(parent, child, module)


def _has_submodule(root: nn.Module, name: str) -> bool:
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def _remove_pruning(module: nn.Module) -> None:
    """Make ``torch.nn.utils.prune`` masks permanent (``ModelPruning(make_pruning_permanent=False)`` keeps them)."""
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(sub, hook._tensor_name)


def _as_inputs(value: Any) -> Inputs:
    if isinstance(value, Inputs):
        return value
    if isinstance(value, torch.Tensor):
        return Inputs((value,))
    if isinstance(value, Mapping):
        return Inputs((), dict(value))
    return Inputs(tuple(value))


class QuantizationAwareTraining(Callback):
    """Quantization-aware training of chosen submodules of a LightningModule.

    The named submodules are fused, traced and prepared for QAT when fit starts: after
    ``LightningModule.setup``/``configure_model`` but before a checkpoint is restored and before
    ``configure_optimizers``, so the optimizer owns the prepared parameters (learnable scales too)
    and a resumed fit loads its state strictly. During training the phase (fake-quant on/off,
    observers running/frozen, BatchNorm statistics updating/frozen) is a pure function of
    ``(global_step, epoch)``. Observers update only inside training steps (and stages listed in
    ``observe_stages``), so validation measures fake-quant quality without moving any scale.
    When fit ends each submodule is converted and lowered to int8 for ``backend`` in place, so
    ``trainer.validate/test/predict`` afterwards run the int8 model.

    Args:
        modules: names (or glob patterns such as ``"encoder.layer.*.output"``) of the submodules
            of the LightningModule to quantize, each prepared and converted on its own.
        backend: int8 kernel library to target, one of ``"x86"``, ``"fbgemm"``, ``"qnnpack"``, ``"onednn"``.
        engine: ``"fx"`` (torch.ao FX graph mode) or ``"pt2e"`` (torchao PT2E), or an engine instance.
        fake_quant_start: when fake-quant turns on, ``{"epoch": N}`` or ``{"step": N}``;
            ``None`` = from the first step. Observers run from the first step regardless.
        observer_freeze: when observers stop updating; ``None`` = never.
        bn_freeze: when BatchNorm running statistics freeze; ``None`` = never.
        qconfig_mapping: the engine's native qconfig mapping (FX: ``QConfigMapping``); ``None``
            uses the backend's default QAT mapping.
        prepare_custom_config: native prepare custom config (FX: ``PrepareCustomConfig``).
        convert_custom_config: native convert custom config (FX: ``ConvertCustomConfig``).
        backend_config: native ``BackendConfig``; ``None`` uses the backend's own.
        example_inputs: ``{module_name: tensor | tuple | dict}`` used instead of capturing inputs
            from ``example_input_array`` or a training batch.
        observe_stages: stages in which observers update, from ``"train"``, ``"validate"``,
            ``"test"``, ``"predict"``. Default ``("train",)``.
        convert_on_fit_end: convert to int8 when fit ends; ``False`` keeps the fake-quant model
            (and allows another ``fit``).
        keep_fake_quant: keep a copy of each fake-quant submodule in :attr:`fake_quant_modules`
            when converting (for reports and parity checks).
        keep_float_snapshot: when fake-quant first turns on, keep the float weights the QAT phase
            starts from (:attr:`float_snapshot`, also saved in checkpoints so a resumed run keeps
            it): the report's fp32 baseline.
        ptq_baseline: when fake-quant starts, also run static PTQ on a copy of the float
            submodule (the weights of :attr:`float_snapshot`) calibrated on this many training
            batches (``True`` = 32), and keep the int8 result in :attr:`ptq_modules`, so the
            report shows fp32 / ptq / fake_quant / int8 side by side. A run resumed after
            fake-quant started builds it at fit end from the saved ``float_snapshot``.
        ptq_qconfig_mapping: the PTQ mapping of that baseline; ``None`` = the PTQ counterpart
            of ``qconfig_mapping`` (:func:`qlightning.qconfigs.ptq_qconfig_mapping`), or the
            backend's default PTQ mapping.

    Example::

        from lightning.pytorch import Trainer
        from qlightning import QuantizationAwareTraining

        qat = QuantizationAwareTraining(modules=["net"], backend="x86", fake_quant_start={"epoch": 2})
        trainer = Trainer(max_epochs=6, callbacks=[qat])
        trainer.fit(model, datamodule=dm)
        trainer.test(model, datamodule=dm)  # runs the int8 model
    """

    def __init__(
        self,
        modules: Union[str, Sequence[str]] = ("net",),
        backend: str = "x86",
        engine: Union[str, QuantEngine] = "fx",
        fake_quant_start: MilestoneLike = None,
        observer_freeze: MilestoneLike = None,
        bn_freeze: MilestoneLike = None,
        qconfig_mapping: Any = None,
        prepare_custom_config: Any = None,
        convert_custom_config: Any = None,
        backend_config: Any = None,
        example_inputs: Optional[Mapping[str, Any]] = None,
        observe_stages: Sequence[str] = ("train",),
        convert_on_fit_end: bool = True,
        keep_fake_quant: bool = True,
        keep_float_snapshot: bool = True,
        ptq_baseline: Union[bool, int] = False,
        ptq_qconfig_mapping: Any = None,
        qconfig_presets: Optional[Mapping[str, Any]] = None,
        equalization: Any = None,
        trusted_modules: Sequence[str] = (),
        engine_options: Optional[Mapping[str, Any]] = None,
        lowering: str = "fx",
        lowering_candidates: Optional[Sequence[str]] = None,
        lowering_batch_size: int = 32,
        lowering_min_sqnr_db: float = 25.0,
    ) -> None:
        errors: list[str] = []
        names = check_common_arguments(modules, backend, engine, errors)
        if isinstance(engine, str):
            check_engine_options(engine, engine_options, errors)
        bad_stages = [s for s in observe_stages if s not in STAGES]
        if bad_stages:
            errors.append(f"observe_stages={list(observe_stages)!r}: unknown stage(s) {bad_stages}; valid: {list(STAGES)}")
        self.schedule = Schedule.from_config(
            fake_quant_start, observer_freeze, bn_freeze, prefix="schedule", errors=errors
        )
        freeze = self.schedule.observer_freeze
        if freeze is not None and (freeze.step == 0 or freeze.epoch == 0):
            errors.append(f"observer_freeze ({freeze}): must be positive, observers need at least one step to calibrate")
        if example_inputs is not None and not isinstance(example_inputs, Mapping):
            errors.append("example_inputs: expected a mapping {module_name: tensor | tuple | dict}")
        if not isinstance(ptq_baseline, (bool, int)) or (not isinstance(ptq_baseline, bool) and ptq_baseline < 1):
            errors.append(f"ptq_baseline={ptq_baseline!r}: True, False or a positive number of calibration batches")
        from qlightning.lowering import CANDIDATES

        if lowering not in ("fx", "auto", *CANDIDATES):
            errors.append(f"lowering={lowering!r}: valid choices: {['fx', 'auto', *CANDIDATES]}")
        bad_candidates = [c for c in (lowering_candidates or ()) if c not in CANDIDATES]
        if bad_candidates:
            errors.append(f"lowering_candidates: unknown {bad_candidates}; valid: {list(CANDIDATES)}")
        if lowering != "fx" and not keep_fake_quant:
            errors.append(f"lowering={lowering!r}: needs keep_fake_quant=True (the fake-quant model is the parity reference)")
        if not isinstance(lowering_batch_size, int) or lowering_batch_size < 1:
            errors.append(f"lowering_batch_size={lowering_batch_size!r}: a positive batch size")

        self.module_names = names
        self.backend = backend
        self._engine_arg = engine
        self._engine: Optional[QuantEngine] = None if isinstance(engine, str) else engine
        options = dict(engine_options or {})
        options.update(qconfig_presets=dict(qconfig_presets or {}), trusted=list(trusted_modules))
        if equalization is not None:
            options["equalization"] = equalization
        self.spec = QuantSpec(
            backend=backend,
            qconfig_mapping=qconfig_mapping,
            prepare_custom_config=prepare_custom_config,
            convert_custom_config=convert_custom_config,
            backend_config=backend_config,
            is_qat=True,
            options=options,
        )
        if not errors:
            try:
                # plain-data configs (dicts, OmegaConf nodes) become torch.ao / torchao objects here,
                # so a typo in a qconfig fails now, not after the first epoch
                self.spec = self.engine.resolve_spec(self.spec, errors)
            except EngineUnavailableError:
                pass  # raised again in setup, where the engine is needed
        if errors:
            raise ConfigError(errors)
        _install_main_process_recovery()  # ddp_spawn/ddp_fork: see the function
        self.example_inputs = {k: _as_inputs(v) for k, v in (example_inputs or {}).items()}
        self.observe_stages = tuple(observe_stages)
        self.convert_on_fit_end = convert_on_fit_end
        self.keep_fake_quant = keep_fake_quant
        self.keep_float_snapshot = keep_float_snapshot
        self.ptq_batches = 32 if ptq_baseline is True else int(ptq_baseline)
        self.ptq_qconfig_mapping = ptq_qconfig_mapping
        #: int8 PTQ baseline of each target (``ptq_baseline=``), not saved in checkpoints
        self.ptq_modules: dict[str, nn.Module] = {}
        # the float submodules before preparation: prepare_qat_fx keeps their Parameter objects,
        # so qlightning.callbacks.ptq.float_module_from() can rebuild float modules from them
        self._float_refs: dict[str, nn.Module] = {}
        # {module name: state_dict} of the prepared modules at the first fake-quant step
        self.float_snapshot: Optional[dict[str, dict[str, torch.Tensor]]] = None

        self.targets: list[str] = []
        self.prepared = False
        self.converted = False
        self.phase: Optional[Phase] = None
        self.fake_quant_modules: dict[str, nn.Module] = {}
        self.lowering = lowering
        self.lowering_candidates = tuple(lowering_candidates) if lowering_candidates else None
        self.lowering_batch_size = lowering_batch_size
        self.lowering_min_sqnr_db = lowering_min_sqnr_db
        #: the engine's converted module of each target (what TorchScript exports), whatever runs in its place
        self.int8_modules: dict[str, nn.Module] = {}
        #: ``lowering != "fx"``: per target, the runtime kept and every candidate's latency and parity
        self.lowering_choices: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, Inputs] = {}
        # Plain data saved in every checkpoint (the resolved recipe, its hash, library versions).
        self.provenance: dict[str, Any] = {}

    @property
    def engine(self) -> QuantEngine:
        if self._engine is None:
            self._engine = get_engine(self._engine_arg)  # type: ignore[arg-type]
        return self._engine

    @property
    def state_key(self) -> str:
        return self._generate_state_key(modules=tuple(self.module_names), backend=self.backend)

    # ------------------------------------------------------------------ preparation

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit" and self.converted:
            raise QLightningError(
                "QuantizationAwareTraining: the model was already converted to int8 at the end of a "
                "previous fit; pass convert_on_fit_end=False to fit more than once"
            )
        if self.prepared:
            return
        start_method = _spawn_start_method(trainer)
        if stage == "fit" and start_method is not None and self.engine.name != "fx":
            names = {"spawn": "'ddp_spawn'", "fork": "'ddp_fork' / 'ddp_notebook'"}.get(start_method, start_method)
            raise ConfigError(
                f"strategy={names} (processes started with {start_method!r}) with engine={self.engine.name!r}: "
                "the main process gets its model back from rank 0 by pickling, and the engine's exported "
                "modules do not pickle; valid choices: strategy='ddp' (Lightning re-launches the script, any "
                "engine), or engine='fx' with a spawn/fork strategy"
            )
        if stage != "fit":
            # validate/test/predict(ckpt_path=<a QAT checkpoint>): prepare when Lightning hands the
            # checkpoint to LightningModule.on_load_checkpoint, just before it loads the weights.
            original_on_load = pl_module.on_load_checkpoint

            def on_load_checkpoint_then_prepare(checkpoint: dict[str, Any]) -> None:
                pl_module.__dict__.pop("on_load_checkpoint", None)
                original_on_load(checkpoint)
                if any(str(k).startswith(type(self).__name__) for k in checkpoint.get("callbacks", {})):
                    self.prepare(pl_module, trainer)

            pl_module.on_load_checkpoint = on_load_checkpoint_then_prepare  # type: ignore[method-assign]
            return
        self.engine  # fail early if the engine cannot run here
        # Prepare right after LightningModule.setup/configure_model (so modules built there exist)
        # and before Lightning restores a checkpoint or calls configure_optimizers.
        original = pl_module.configure_model

        def configure_model_then_prepare() -> None:
            pl_module.__dict__.pop("configure_model", None)  # back to the class's (or another wrapper's) method
            original()
            pruned = self._name_pruned_parameters(trainer, pl_module)
            self.prepare(pl_module, trainer)
            self._repoint_pruning(pl_module, pruned)

        pl_module.configure_model = configure_model_then_prepare  # type: ignore[method-assign]

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # drop hook wrappers that were never called (no checkpoint loaded): a LightningModule must
        # stay picklable and free of references to this callback
        for hook in ("configure_model", "on_load_checkpoint"):
            pl_module.__dict__.pop(hook, None)

    def _batch_source(self, trainer: "pl.Trainer") -> Any:
        def first_batch() -> Any:
            source = trainer.fit_loop._data_source
            if not source.is_defined():
                return None
            loader = source.dataloader()
            return next(iter(loader))

        return first_batch

    def prepare(self, pl_module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None) -> None:
        """Prepare every target submodule of ``pl_module`` in place (idempotent).

        Called by the Trainer; call it yourself to rebuild a fake-quant model without a Trainer.
        """
        if self.prepared:
            return
        self.targets = resolve_targets(pl_module, self.module_names, key="modules")
        problems = self.engine.check_spec_against_model(self.spec, {n: pl_module.get_submodule(n) for n in self.targets})
        if problems:
            raise ConfigError(problems)
        self.inputs = example_inputs_for(
            pl_module,
            self.targets,
            batch_source=self._batch_source(trainer) if trainer is not None else None,
            configured=self.example_inputs,
        )
        for name in self.targets:
            float_module = pl_module.get_submodule(name)
            if self.ptq_batches:
                self._float_refs[name] = float_module
            prepared = self.engine.prepare(float_module, self.inputs[name], self.spec)
            _set_submodule(pl_module, name, prepared)
        self.prepared = True
        self._apply(pl_module, self.schedule.phase(0, 0))
        self._set_observers(pl_module, False)
        rank_zero_info(
            f"[qlightning] prepared {self.targets} for QAT ({self.engine.name} engine, {self.backend} backend); "
            f"schedule: fake-quant from {self.schedule.fake_quant_start or 'step 0'}, "
            f"observers freeze at {self.schedule.observer_freeze or 'never'}, "
            f"BN freezes at {self.schedule.bn_freeze or 'never'}"
        )

    # ------------------------------------------------------------------ ModelPruning

    def _name_pruned_parameters(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> list[tuple[Any, ...]]:
        """Before prepare: the ``ModelPruning`` parameters inside the quantized modules, by name.

        ``ModelPruning.setup`` collects its ``(module, name)`` pairs before ``configure_model``, from
        the float modules that prepare then replaces: left alone it would prune modules that are no
        longer in the model (silently: the trained and converted model is not sparse).
        """
        callbacks = [c for c in trainer.callbacks if isinstance(c, ModelPruning)]
        if not callbacks:
            return []
        targets = resolve_targets(pl_module, self.module_names, key="modules")
        names = {id(m): n for n, m in pl_module.named_modules()}

        def inside(name: str) -> bool:
            return any(name == t or name.startswith(t + ".") for t in targets)

        found = []
        for callback in callbacks:
            pairs = list(callback._parameters_to_prune)
            default = callback.filter_parameters_to_prune(
                ModelPruning.sanitize_parameters_to_prune(pl_module, (), parameter_names=callback._parameter_names)
            )
            is_default = [(id(m), p) for m, p in default] == [(id(m), p) for m, p in pairs]
            moved = [(i, names[id(m)], p) for i, (m, p) in enumerate(pairs) if id(m) in names and inside(names[id(m)])]
            if moved:
                found.append((callback, moved, is_default))
        return found

    def _repoint_pruning(self, pl_module: "pl.LightningModule", found: list[tuple[Any, ...]]) -> None:
        """After prepare: point ``ModelPruning`` at the prepared modules of the same names.

        A fused conv keeps the conv's name, so its weight is pruned (and the mask goes through
        fake-quant and into the int8 weight); a BatchNorm folded into its conv has no module of its
        own any more: dropped from ``ModelPruning``'s default selection, an error when listed explicitly.
        """
        errors: list[str] = []
        for callback, moved, is_default in found:
            if self.engine.name != "fx":
                errors.append(
                    f"ModelPruning: prunes {[f'{n}.{p}' for _, n, p in moved][:4]}... inside the quantized modules "
                    f"{self.targets}; only the fx engine keeps their names when preparing (this run: {self.engine.name!r})"
                )
                continue
            pairs = list(callback._parameters_to_prune)
            dropped: dict[int, str] = {}
            for i, name, param in moved:
                module = pl_module.get_submodule(name) if _has_submodule(pl_module, name) else None
                if module is not None and isinstance(module._parameters.get(param), nn.Parameter):
                    pairs[i] = (module, param)
                else:
                    dropped[i] = f"{name}.{param}"
            if dropped and not is_default:
                errors.append(
                    f"ModelPruning(parameters_to_prune=...): {sorted(dropped.values())} are not parameters of the "
                    f"model QAT prepares (a BatchNorm folded into its conv, or a module fused away); prune the "
                    f"conv/linear weights only"
                )
                continue
            if dropped:
                rank_zero_info(f"[qlightning] ModelPruning: not pruning {sorted(dropped.values())} (folded by QAT fusion)")
            callback._parameters_to_prune = [pair for i, pair in enumerate(pairs) if i not in dropped]
            if getattr(callback, "_original_layers", None) is not None:  # lottery ticket: initial weights of the new modules
                callback._original_layers = {}
                for i, (module, param) in enumerate(callback._parameters_to_prune):
                    entry = callback._original_layers.setdefault(id(module), {"data": copy.deepcopy(module), "names": []})
                    entry["names"].append((i, param))
        if errors:
            raise ConfigError(errors)

    # ------------------------------------------------------------------ schedule

    def _apply(self, pl_module: "pl.LightningModule", phase: Phase) -> None:
        for name in self.targets:
            self.engine.set_phase(pl_module.get_submodule(name), phase)

    def _set_observers(self, pl_module: "pl.LightningModule", enabled: bool) -> None:
        for name in self.targets:
            self.engine.set_observers(pl_module.get_submodule(name), enabled)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if not self.prepared or self.converted:
            return
        phase = self.schedule.phase(trainer.global_step, trainer.current_epoch)
        if phase != self.phase:
            rank_zero_info(
                f"[qlightning] step {trainer.global_step} (epoch {trainer.current_epoch}): {phase.describe()}"
            )
            self.phase = phase
        if phase.fake_quant and self.float_snapshot is None and self.keep_float_snapshot:
            self.float_snapshot = {
                name: {k: v.detach().clone() for k, v in pl_module.get_submodule(name).state_dict().items()}
                for name in self.targets
            }
            if self.ptq_batches and not self.ptq_modules:
                self._run_ptq_baseline(trainer, pl_module)  # before fake-quant is applied: float weights
        if trainer.loggers:
            for key, value in vars(phase).items():
                pl_module.log(f"qat/{key}", float(value), on_step=True, on_epoch=False)
            if trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
                # activation scales over training: the report plots their evolution
                for name in self.targets:
                    for key, q in self.engine.describe_qparams(pl_module.get_submodule(name)).items():
                        if "weight_fake_quant" not in key:
                            pl_module.log(f"qat/scale/{name}.{key}", q["scale_mean"], on_step=True, on_epoch=False)
        # applied every batch: Lightning's model.train() after validation resets BatchNorm modes
        self._apply(pl_module, phase)

    def _run_ptq_baseline(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", states: Optional[dict[str, Any]] = None
    ) -> None:
        """PTQ of the float weights (live, or ``states`` saved at fake-quant start) on training batches."""
        from qlightning.callbacks.ptq import calibration_batches, collect_inputs, float_module_from, ptq_baseline
        from qlightning.capture import _RandomStates

        with _RandomStates():
            batches = calibration_batches(trainer, "train", self.ptq_batches)
        inputs = collect_inputs(pl_module, self.targets, batches, "train", trainer)
        for name in self.targets:
            state = None if states is None else states[name]
            float_module = float_module_from(self._float_refs[name], pl_module.get_submodule(name), state)
            self.ptq_modules[name] = ptq_baseline(
                float_module, inputs[name], self.spec, engine=self.engine, qconfig_mapping=self.ptq_qconfig_mapping
            )
        rank_zero_info(
            f"[qlightning] PTQ baseline of {self.targets} (float weights at fake-quant start, "
            f"{len(inputs[self.targets[0]])} calibration batches)"
        )

    @override
    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Observers update only inside training steps: no summary, sanity check or other callback's
        # forward pass can move a scale.
        if self.prepared and not self.converted:
            self._set_observers(pl_module, False)

    def _evaluation(self, pl_module: "pl.LightningModule", stage: str, start: bool) -> None:
        if self.prepared and not self.converted:
            self._set_observers(pl_module, start and stage in self.observe_stages)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # Lightning validates at an epoch's end *before* on_train_epoch_end: give every rank rank 0's
        # observer/BN state so validation measures the model that is checkpointed and converted
        self._sync(trainer, pl_module)
        self._evaluation(pl_module, "validate", True)

    @override
    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._evaluation(pl_module, "validate", False)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._evaluation(pl_module, "test", True)

    @override
    def on_test_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._evaluation(pl_module, "test", False)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._evaluation(pl_module, "predict", True)

    @override
    def on_predict_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._evaluation(pl_module, "predict", False)

    # ------------------------------------------------------------------ distributed

    def _sync(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.prepared and not self.converted:
            broadcast_buffers(trainer, (pl_module.get_submodule(name) for name in self.targets))

    @override
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # before ModelCheckpoint saves (it runs after callbacks registered earlier); validation already ran
        self._sync(trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: dict) -> None:
        # a mid-epoch checkpoint is written by rank 0 only; it must hold what every rank will convert
        self._sync(trainer, pl_module)

    # ------------------------------------------------------------------ conversion

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._sync(trainer, pl_module)
        if self.ptq_batches and not self.ptq_modules and self.float_snapshot is not None and self.prepared:
            self._run_ptq_baseline(trainer, pl_module, self.float_snapshot)  # resumed after fake-quant start
        if self.convert_on_fit_end and self.prepared and not self.converted:
            if is_distributed(trainer):
                self._convert_on_rank_zero(trainer, pl_module)
            else:
                self.convert(pl_module)
        if self.prepared and _spawn_start_method(trainer) is not None and trainer.is_global_zero:
            self._send_to_main_process(trainer, pl_module)

    def convert(self, pl_module: "pl.LightningModule") -> None:
        """Convert every prepared submodule to int8 for the backend, in place."""
        for name in self.targets:
            prepared = self._before_convert(pl_module, name)
            int8 = self.engine.convert(prepared, self.spec)
            self.int8_modules[name] = int8
            _set_submodule(pl_module, name, int8)
            if self.lowering != "fx" and name in self.fake_quant_modules:
                _set_submodule(pl_module, name, self._lower(pl_module, name, int8))
        self.converted = True
        rank_zero_info(f"[qlightning] converted {self.targets} to int8 ({self.backend})")

    def _before_convert(self, pl_module: "pl.LightningModule", name: str) -> nn.Module:
        prepared = pl_module.get_submodule(name)
        self.engine.set_observers(prepared, False)
        if self.keep_fake_quant:
            self.fake_quant_modules[name] = copy.deepcopy(prepared).eval()
        _remove_pruning(prepared)  # masks folded into the weights, so convert reads current ones
        return prepared

    # ------------------------------------------------------------------ conversion on rank 0 only

    def _convert_on_rank_zero(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Under DDP: rank 0 converts (and, for ``lowering != "fx"``, times the runtimes and chooses);
        the other ranks receive its int8 modules and choice through the strategy's ``broadcast``.

        The buffers were just broadcast from rank 0, so every rank holds the model rank 0 converts.
        A module that does not pickle (e.g. PT2E's exported graphs) is converted on each rank
        instead, and rank 0's int8 state_dict is then loaded into it strictly.
        """
        message: Optional[dict[str, Any]] = None
        if trainer.is_global_zero:
            try:
                self.convert(pl_module)
                message = self._conversion_message(pl_module)
            except BaseException as exc:
                # tell the other ranks (waiting in the broadcast below) before raising here
                broadcast_object(trainer, {"error": f"{type(exc).__name__}: {exc}"})
                raise
        message = broadcast_object(trainer, message)
        if trainer.is_global_zero:
            return
        if "error" in message:
            raise QLightningError(f"QuantizationAwareTraining: rank 0 failed to convert to int8: {message['error']}")
        self._receive_conversion(pl_module, message)

    def _conversion_message(self, pl_module: "pl.LightningModule") -> dict[str, Any]:
        message: dict[str, Any] = {"int8": {}, "int8_state": {}, "lowered": {}, "lowering_choices": self.lowering_choices}
        for name in self.targets:
            int8 = self.int8_modules[name]
            try:
                message["int8"][name] = dumps_modules(int8)
            except Exception:  # converted on every rank, then loaded with rank 0's values
                buffer = io.BytesIO()
                torch.save(int8.state_dict(), buffer)
                message["int8_state"][name] = buffer.getvalue()
            lowered = pl_module.get_submodule(name)
            if lowered is not int8:
                try:
                    message["lowered"][name] = dumps_modules(lowered)
                except Exception:
                    message["lowered"][name] = None  # rebuilt from the choice on each rank
        return message

    def _receive_conversion(self, pl_module: "pl.LightningModule", message: dict[str, Any]) -> None:
        for name in self.targets:
            prepared = self._before_convert(pl_module, name)
            if name in message["int8"]:
                int8 = loads_modules(message["int8"][name])
            else:
                int8 = self.engine.convert(prepared, self.spec)
                state = torch.load(io.BytesIO(message["int8_state"][name]), weights_only=False)
                int8.load_state_dict(state, strict=True)
            self.int8_modules[name] = int8
            module = int8
            _set_submodule(pl_module, name, int8)
            choice = message["lowering_choices"].get(name)
            if choice is not None:
                self.lowering_choices[name] = choice
                module = self._lowered_from(pl_module, name, int8, choice["name"], message["lowered"].get(name))
            _set_submodule(pl_module, name, module)
        self.converted = True

    def _lowered_from(
        self, pl_module: "pl.LightningModule", name: str, int8: nn.Module, runtime: str, data: Optional[bytes]
    ) -> nn.Module:
        """The runtime rank 0 chose for ``name``: its pickled module, or built again (not timed) here."""
        from qlightning.lowering import BUILDERS, LoweringContext, _attach_source

        if runtime == "fx":
            return int8
        if data is not None:
            return _attach_source(loads_modules(data), int8)
        from qlightning.export import qdq_module
        from qlightning.report import _tile

        example = self.inputs[name]
        batch = Inputs(_tile(example.args, self.lowering_batch_size), _tile(example.kwargs, self.lowering_batch_size))
        try:
            reference = qdq_module(self, pl_module, name)
        except Exception:
            reference = None
        return BUILDERS[runtime](LoweringContext(self.fake_quant_modules[name], int8, batch, qdq_module=reference))

    # ------------------------------------------------------------------ spawn/fork strategies

    def _send_to_main_process(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Rank 0 of ``ddp_spawn``/``ddp_fork``: hand the QAT result to Lightning's launcher for the main process.

        Lightning returns rank 0's final ``state_dict`` to the main process and loads it with
        ``strict=False`` into a model that was never prepared nor converted (this is a copy of the
        callback; the main process has its own). The launcher's ``get_extra_results`` is the
        documented channel for extra results: this process's launcher (and only it) gets a wrapper
        that adds ours; the main process's side is :func:`_install_main_process_recovery`.
        """
        # A file, like Lightning's own weights: the launcher joins the processes before it reads its
        # queue, so a payload larger than a pipe's buffer (64 KiB) would block rank 0 forever (measured).
        path = os.path.join(tempfile.mkdtemp(prefix="qlightning-"), "qat.pkl")
        with open(path, "wb") as f:
            f.write(self._main_process_payload(pl_module))
        launcher = trainer.strategy.launcher
        original = launcher.get_extra_results
        key = self.state_key

        def get_extra_results(trainer: "pl.Trainer") -> dict[str, Any]:
            extra = original(trainer)
            extra.setdefault(_EXTRA_KEY, {})[key] = path
            return extra

        launcher.get_extra_results = get_extra_results  # type: ignore[method-assign]

    def _main_process_payload(self, pl_module: "pl.LightningModule") -> bytes:
        if self.converted:
            fake_quant = {name: m.state_dict() for name, m in self.fake_quant_modules.items()}
        else:
            fake_quant = {name: pl_module.get_submodule(name).state_dict() for name in self.targets}
        lowered: dict[str, Optional[bytes]] = {}
        for name in self.lowering_choices:
            module = pl_module.get_submodule(name)
            try:
                lowered[name] = None if module is self.int8_modules.get(name) else dumps_modules(module)
            except Exception:
                lowered[name] = None
        ptq: dict[str, bytes] = {}
        for name, module in self.ptq_modules.items():
            try:
                ptq[name] = dumps_modules(module)
            except Exception as exc:
                rank_zero_warn(f"[qlightning] the PTQ baseline of {name!r} does not reach the main process: {exc}")
        return dumps_modules(
            {
                "targets": list(self.targets),
                "converted": self.converted,
                "phase": None if self.phase is None else vars(self.phase).copy(),
                "provenance": self.provenance,
                "float_snapshot": self.float_snapshot,
                "inputs": self.inputs,
                "fake_quant_state": fake_quant,
                "keep_fake_quant": self.keep_fake_quant and self.converted,
                "int8": {name: self.int8_modules[name] for name in self.targets} if self.converted else {},
                "lowered": lowered,
                "lowering_choices": self.lowering_choices,
                "ptq_modules": ptq,
                "state_keys": list(pl_module.state_dict().keys()),
            }
        )

    def _restore_in_main_process(self, pl_module: "pl.LightningModule", payload: bytes) -> list[str]:
        """The main process: rebuild what rank 0 ended with. Returns the state_dict keys rank 0 had.

        The fake-quant model is prepared again here from this process's float submodule (with rank 0's
        example inputs) and loaded strictly with rank 0's state: PT2E's exported modules do not pickle,
        and a pickled FX one would lose the engine's training paths (instance methods; see
        engines/fast_fq.py). The int8 modules are rank 0's own, unpickled.
        """
        data = loads_modules(payload)
        self.targets = data["targets"]
        self.inputs = data["inputs"]
        self.phase = Phase(**data["phase"]) if data["phase"] else None
        self.provenance = data["provenance"]
        self.float_snapshot = data["float_snapshot"]
        for name in self.targets:
            try:
                float_module = pl_module.get_submodule(name)
            except AttributeError as exc:
                raise QLightningError(
                    f"QuantizationAwareTraining: {name!r} is not a submodule of the main process's model (built in "
                    "configure_model?), so rank 0's QAT result cannot be put back there; use strategy='ddp'"
                ) from exc
            if self.ptq_batches:
                self._float_refs[name] = float_module
            prepared = self.engine.prepare(copy.deepcopy(float_module), self.inputs[name], self.spec)
            prepared.load_state_dict(data["fake_quant_state"][name], strict=True)
            if self.phase is not None:
                self.engine.set_phase(prepared, self.phase)
            self.engine.set_observers(prepared, False)
            if not data["converted"]:
                _set_submodule(pl_module, name, prepared)
                continue
            if data["keep_fake_quant"]:
                self.fake_quant_modules[name] = prepared.eval()
            int8 = data["int8"][name]
            self.int8_modules[name] = int8
            module = int8
            _set_submodule(pl_module, name, int8)
            if name in data["lowering_choices"]:
                self.lowering_choices[name] = data["lowering_choices"][name]
                module = self._lowered_from(pl_module, name, int8, self.lowering_choices[name]["name"], data["lowered"].get(name))
            _set_submodule(pl_module, name, module)
        self.ptq_modules = {name: loads_modules(b) for name, b in data["ptq_modules"].items()}
        self.prepared = True
        self.converted = data["converted"]
        # the same Trainer may validate/test/predict next, spawning processes that receive this model
        for name in self.targets:
            for module in {id(m): m for m in (pl_module.get_submodule(name), self.int8_modules.get(name)) if m is not None}.values():
                if isinstance(module, torch.fx.GraphModule):
                    pickle_whole_for_new_processes(module)
        return data["state_keys"]

    def __getstate__(self) -> dict[str, Any]:
        # Pickled copies (the processes a spawn strategy starts for a validate/test/predict after a
        # spawn fit) carry the model's state but not the fake-quant copies kept for reports and
        # lowering: FX-prepared modules do not pickle, and those processes never use them.
        state = self.__dict__.copy()
        engine = self._engine_arg if isinstance(self._engine_arg, str) else getattr(self._engine_arg, "name", None)
        if engine == "fx":
            state["fake_quant_modules"] = {}
        return state

    def _lower(self, pl_module: "pl.LightningModule", name: str, int8: nn.Module) -> nn.Module:
        """``lowering=auto|onnxruntime|inductor``: the fastest faithful runtime for ``name`` (else ``int8``)."""
        import warnings

        from qlightning.export import qdq_module
        from qlightning.lowering import CANDIDATES, choose_lowering
        from qlightning.report import _tile

        if self.lowering_candidates:
            candidates = self.lowering_candidates
        else:
            candidates = CANDIDATES if self.lowering == "auto" else ("fx", self.lowering)
        example = self.inputs[name]
        batch = Inputs(_tile(example.args, self.lowering_batch_size), _tile(example.kwargs, self.lowering_batch_size))
        try:
            reference = qdq_module(self, pl_module, name)
        except Exception:
            reference = None  # choose_lowering builds its own
        try:
            choice = choose_lowering(
                self.fake_quant_modules[name], int8, batch, candidates=candidates,
                min_sqnr_db=self.lowering_min_sqnr_db, qdq_module=reference,
            )
        except Exception as exc:  # the engine's module is always a valid answer
            warnings.warn(f"qlightning lowering of {name!r} failed, keeping the {self.engine.name} int8 module: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
            return int8
        self.lowering_choices[name] = choice.to_dict()
        rank_zero_info(
            f"[qlightning] {name}: lowering={self.lowering} kept {choice.name!r} "
            f"(median ms at batch {choice.batch_size}: {choice.latency_ms}; SQNR dB vs fake-quant: {choice.sqnr_db}"
            + (f"; not eligible: {choice.errors}" if choice.errors else "") + ")"
        )
        return choice.module

    # ------------------------------------------------------------------ checkpoint state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "engine": self.engine.name,
            "backend": self.backend,
            "modules": list(self.targets),
            "converted": self.converted,
            "phase": None if self.phase is None else vars(self.phase).copy(),
            "provenance": self.provenance,
            "float_snapshot": self.float_snapshot,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("modules")
        if self.prepared and saved is not None and list(saved) != self.targets:
            raise ConfigError(
                f"modules: the checkpoint was trained with quantized modules {saved}, this run prepares {self.targets}"
            )
        if state_dict.get("backend") not in (None, self.backend):
            raise ConfigError(
                f"backend={self.backend!r}: the checkpoint was trained for backend {state_dict['backend']!r}"
            )
        phase = state_dict.get("phase")
        self.phase = Phase(**phase) if phase else None
        self.provenance = self.provenance or dict(state_dict.get("provenance") or {})
        self.float_snapshot = state_dict.get("float_snapshot")


def _spawn_start_method(trainer: Any) -> Optional[str]:
    """``"spawn"``/``"fork"``/``"forkserver"`` when Lightning started the processes itself and joins
    them in a main process (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), else ``None``."""
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    launcher = getattr(trainer.strategy, "launcher", None)
    return launcher._start_method if isinstance(launcher, _MultiProcessingLauncher) else None


#: key of the QAT results in the extra results Lightning's multiprocessing launcher returns
_EXTRA_KEY = "qlightning_qat"


def _install_main_process_recovery() -> None:
    """Let ``ddp_spawn``/``ddp_fork``/``ddp_notebook`` give the main process the converted model.

    After the processes join, Lightning's ``_MultiProcessingLauncher._recover_results_in_main_process``
    loads rank 0's final ``state_dict`` into the main process's model with ``strict=False``. That
    model was never prepared nor converted (preparation ran in the workers), so the int8 weights
    would not fit it (quantized tensors do not copy into float parameters) or, worse, be skipped
    silently. No callback hook runs in the main process then, so we wrap that one method, on the
    class (the main process's launcher instance is created before any callback hook runs): before
    Lightning's loading, each ``QuantizationAwareTraining`` of the trainer rebuilds rank 0's modules
    from what rank 0 sent (see ``_send_to_main_process``), so the state_dict fits exactly; after it,
    the keys are checked. Runs without a QAT callback are passed straight through. Idempotent.
    """
    from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher

    original = _MultiProcessingLauncher._recover_results_in_main_process
    if getattr(original, "_qlightning", False):
        return

    def _recover_results_in_main_process(self: Any, worker_output: Any, trainer: "pl.Trainer") -> None:
        callbacks = [c for c in trainer.callbacks if isinstance(c, QuantizationAwareTraining)]
        sent = (worker_output.extra or {}).get(_EXTRA_KEY, {})
        expected: dict[str, list[str]] = {}
        if worker_output.weights_path is not None:  # a fit: rank 0's weights come back
            for callback in callbacks:
                if callback.state_key not in sent:
                    raise QLightningError(
                        "QuantizationAwareTraining: rank 0 did not send its QAT state back to the main process "
                        "(the fit did not reach on_fit_end), so the main process's model cannot receive its "
                        "weights; resume from the last checkpoint with strategy='ddp'"
                    )
                path = sent[callback.state_key]
                with open(path, "rb") as f:
                    payload = f.read()
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                expected[callback.state_key] = callback._restore_in_main_process(trainer.lightning_module, payload)
        original(self, worker_output, trainer)
        for keys in expected.values():
            held = list(trainer.lightning_module.state_dict().keys())
            if set(held) != set(keys):
                raise QLightningError(
                    "QuantizationAwareTraining: the main process's model does not have rank 0's structure after "
                    f"the spawn strategy returned: missing {sorted(set(keys) - set(held))[:8]}, "
                    f"unexpected {sorted(set(held) - set(keys))[:8]}"
                )

    _recover_results_in_main_process._qlightning = True  # type: ignore[attr-defined]
    _MultiProcessingLauncher._recover_results_in_main_process = _recover_results_in_main_process  # type: ignore[method-assign]
