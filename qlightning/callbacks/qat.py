"""QuantizationAwareTraining: prepare at fit start, follow the schedule, convert at fit end."""

from __future__ import annotations

import copy
import time
from typing import Any, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, StochasticWeightAveraging
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from qlightning.callbacks import lightning_compat as compat
from qlightning.callbacks.base import SessionCallback, check_common_arguments
from qlightning.callbacks.calibration_data import calibration_batches, collect_inputs
from qlightning.quantize.calibration import run_to_targets
from qlightning.callbacks.distributed import (
    RankZeroHandOver,
    broadcast_buffers,
    destroy_gloo_group_at_exit,
    install_main_process_recovery,
    is_distributed,
)
from qlightning.callbacks.pruning import name_pruned_parameters, repoint_pruning
from qlightning.core.inputs import RandomStates, as_inputs
from qlightning.core.compile_choice import CompileDecider, phases_left
from qlightning.core.fidelity import FidelityConfig, ModuleFidelity, apply_on_breach, compare_modules
from qlightning.core.schedule import AUTO, AutoSchedule, Milestone, MilestoneLike, Phase, Schedule, unreachable
from qlightning.core.session import QuantSession, set_submodule
from qlightning.engines import QuantEngine, QuantSpec, check_engine_options, compile_mode, engine_class
from qlightning.errors import ConfigError, EngineUnavailableError, IncompleteScheduleError, QLightningError
from qlightning.quantize.lowering import CANDIDATES, ENGINE_MODULE

STAGES = ("train", "validate", "test", "predict")
ON_INCOMPLETE = ("calibrate", "error")
# fake-quant ops (fused_moving_avg_obs_fake_quant, torchao's fake-quant) run in float32 only
FLOAT32_PRECISIONS = ("32-true", "32", 32, "64-true", "64", 64)
STATE_VERSION = 1


#: the auto schedule's fake-quant start until the run's length is known (float, observers on, until then)
_AUTO_PENDING = Milestone(step=2**62)

class QuantizationAwareTraining(SessionCallback, RankZeroHandOver, Callback):
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
            ``"auto"`` (the default, with the two below also ``"auto"``): the schedule is derived
            from the run's length (``trainer.estimated_stepping_batches``): float for the first half
            of the steps, fake-quant after, observers frozen for the last 15 %, BatchNorm never frozen
            (:class:`~qlightning.core.schedule.AutoSchedule`). Giving any milestone turns the
            derivation off; the others then mean what ``None`` means. Milestones the fit never
            reaches are a :class:`ConfigError` in ``setup``.
        observer_freeze: when observers stop updating; ``None`` = never.
        bn_freeze: when BatchNorm running statistics freeze; ``None`` = never.
        qconfig_mapping: the engine's native qconfig mapping (FX: ``QConfigMapping``); ``None``
            uses the backend's default QAT mapping with the weight fake-quants on the current weights'
            range, centred on zero (``qlightning.engines.fx.weights``; a lagging range collapsed short runs).
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
            of ``qconfig_mapping`` (:func:`qlightning.engines.fx.qconfigs.ptq_qconfig_mapping`), or the
            backend's default PTQ mapping.
        qconfig_presets: ``{name: qconfig spec}`` of named qconfigs a plain-data ``qconfig_mapping``
            may refer to (config: ``quant.qconfig_presets``), besides the built-in presets.
        equalization: FX input-weight equalization (``"all"``, layer names, ``"selective"`` or a
            ``QConfigMapping``); PTQ only, so a QAT run refuses it with the reason.
        trusted_modules: module prefixes whose classes a plain-data config may name (custom-module
            mappings, ``object_type`` entries) beyond the built-in allowlist.
        engine_options: the engine's own switches (see ``qlightning.engines.ENGINE_OPTIONS``), checked
            per engine: unknown names and wrong kinds are errors listing the valid ones.
        lowering: the int8 runtime kept at fit end: ``"fx"`` (the engine's module), ``"auto"`` (the
            fastest runtime faithful to the fake-quant model), ``"onnxruntime"`` or ``"inductor"``.
        lowering_candidates: the runtimes ``lowering="auto"`` chooses from (default: all).
        lowering_batch_size: the batch size candidates are timed and checked at: the held batches
            (validation loader, else training batches; ``fidelity.batches`` of them) regrouped into it,
            else the example input tiled to it.
        lowering_min_sqnr_db: SQNR a runtime needs against the fake-quant model to be kept.
        fidelity: the fit-end gate comparing the int8 model as it runs with the fake-quant model on
            held batches (validation loader, else training batches): ``True`` (defaults), ``False``,
            a mapping or a :class:`~qlightning.core.fidelity.FidelityConfig` (``min_sqnr_db``,
            ``min_top1_agreement``, ``on_breach`` fail | warn | fallback, ``batches``).
            Results are in :attr:`fidelity_results`.
        on_incomplete_schedule: what to do when the fit ends before fake-quant started (EarlyStopping,
            an interrupt): ``"calibrate"`` (run the observers and fake-quant on training batches
            first, so no scale is uninitialised, and warn that the model was never trained against
            quantization) or ``"error"`` (refuse to convert).
        calibration_batches: training batches used by ``on_incomplete_schedule="calibrate"``.

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
        fake_quant_start: MilestoneLike = AUTO,
        observer_freeze: MilestoneLike = AUTO,
        bn_freeze: MilestoneLike = AUTO,
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
        fidelity: Any = True,
        on_incomplete_schedule: str = "calibrate",
        calibration_batches: int = 16,
    ) -> None:
        errors: list[str] = []
        names = check_common_arguments(modules, backend, engine, errors)
        if isinstance(engine, str):
            check_engine_options(engine, engine_options, errors)
        bad_stages = [s for s in observe_stages if s not in STAGES]
        if bad_stages:
            errors.append(f"observe_stages={list(observe_stages)!r}: unknown stage(s) {bad_stages}; valid: {list(STAGES)}")
        milestones = (fake_quant_start, observer_freeze, bn_freeze)
        self.auto_schedule: Optional[AutoSchedule] = AutoSchedule() if all(m == AUTO for m in milestones) else None
        self.schedule = Schedule.from_config(
            *(None if m == AUTO else m for m in milestones), prefix="schedule", errors=errors
        )
        if self.auto_schedule is not None:  # float (observers on) until the run's length is known
            self.schedule = Schedule(fake_quant_start=_AUTO_PENDING)
        self.fidelity = FidelityConfig.from_value(fidelity, errors, "fidelity")
        if on_incomplete_schedule not in ON_INCOMPLETE:
            errors.append(f"on_incomplete_schedule={on_incomplete_schedule!r}: valid choices: {list(ON_INCOMPLETE)}")
        if isinstance(calibration_batches, bool) or not isinstance(calibration_batches, int) or calibration_batches < 1:
            errors.append(f"calibration_batches={calibration_batches!r}: a positive number of batches")
        freeze = self.schedule.observer_freeze
        if freeze is not None and (freeze.step == 0 or freeze.epoch == 0):
            errors.append(f"observer_freeze ({freeze}): must be positive, observers need at least one step to calibrate")
        if example_inputs is not None and not isinstance(example_inputs, Mapping):
            errors.append("example_inputs: expected a mapping {module_name: tensor | tuple | dict}")
        if not isinstance(ptq_baseline, (bool, int)) or (not isinstance(ptq_baseline, bool) and ptq_baseline < 1):
            errors.append(f"ptq_baseline={ptq_baseline!r}: True, False or a positive number of calibration batches")
        if lowering not in (ENGINE_MODULE, "auto", *CANDIDATES):
            errors.append(f"lowering={lowering!r}: valid choices: {[ENGINE_MODULE, 'auto', *CANDIDATES]}")
        bad_candidates = [c for c in (lowering_candidates or ()) if c not in CANDIDATES]
        if bad_candidates:
            errors.append(f"lowering_candidates: unknown {bad_candidates}; valid: {list(CANDIDATES)}")
        if lowering != ENGINE_MODULE and not keep_fake_quant:
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
        spec = QuantSpec(
            backend=backend,
            qconfig_mapping=qconfig_mapping,
            prepare_custom_config=prepare_custom_config,
            convert_custom_config=convert_custom_config,
            backend_config=backend_config,
            is_qat=True,
            options=options,
        )
        self.ptq_batches = 32 if ptq_baseline is True else (int(ptq_baseline) if isinstance(ptq_baseline, int) else 0)
        self.session = QuantSession(
            self._engine,  # type: ignore[arg-type]  # resolved on first use of self.engine
            spec,
            names,
            example_inputs={k: as_inputs(v) for k, v in (example_inputs or {}).items()} if isinstance(example_inputs, Mapping) else None,
            keep_fake_quant=keep_fake_quant,
            keep_float_refs=bool(self.ptq_batches),
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
        install_main_process_recovery()  # ddp_spawn/ddp_fork: see the function
        self.example_inputs = self.session.example_inputs
        self.observe_stages = tuple(observe_stages)
        self.convert_on_fit_end = convert_on_fit_end
        self.keep_fake_quant = keep_fake_quant
        self.keep_float_snapshot = keep_float_snapshot
        self.ptq_qconfig_mapping = ptq_qconfig_mapping
        self.lowering = lowering
        self.lowering_candidates = tuple(lowering_candidates) if lowering_candidates else None
        self.lowering_batch_size = lowering_batch_size
        self.lowering_min_sqnr_db = lowering_min_sqnr_db
        self.on_incomplete_schedule = on_incomplete_schedule
        self.calibration_batches = calibration_batches
        self._held_batches: dict[str, list[Any]] = {}
        self._held_source = ""
        self._convert_after_load = False
        self._compiler: Optional[CompileDecider] = None  # engine_options.compile, from prepare on
        self._step_started: Optional[float] = None

    # ------------------------------------------------------------------ preparation

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        destroy_gloo_group_at_exit(trainer)
        if stage == "fit" and self.converted:
            raise QLightningError(
                "QuantizationAwareTraining: the model was already converted to int8 at the end of a "
                "previous fit; pass convert_on_fit_end=False to fit more than once"
            )
        if stage != "fit":
            # validate/test/predict(ckpt_path=<a QAT checkpoint>): prepare (or, after a fit, put the
            # fake-quant modules back) when Lightning hands the checkpoint to on_load_checkpoint
            self._wrap_on_load_checkpoint(trainer, pl_module, stage)
            return
        if self.prepared:
            return
        start_method = compat.spawn_start_method(trainer)
        if stage == "fit" and start_method is not None and not self.engine.spawn_hand_over:
            names = {"spawn": "'ddp_spawn'", "fork": "'ddp_fork' / 'ddp_notebook'"}.get(start_method, start_method)
            raise ConfigError(
                f"strategy={names} (processes started with {start_method!r}) with engine={self.engine.name!r}: "
                "the main process gets its model back from rank 0 by pickling, and the engine's exported "
                "modules do not pickle; valid choices: strategy='ddp' (Lightning re-launches the script, any "
                "engine), or engine='fx' with a spawn/fork strategy"
            )
        self._refuse_combinations(trainer)
        self.engine  # fail early if the engine cannot run here
        self._wrap_on_load_checkpoint(trainer, pl_module, stage)
        # Prepare right after LightningModule.setup/configure_model (so modules built there exist)
        # and before Lightning restores a checkpoint or calls configure_optimizers.
        original = pl_module.configure_model

        def configure_model_then_prepare() -> None:
            pl_module.__dict__.pop("configure_model", None)  # back to the class's (or another wrapper's) method
            original()
            pruned = name_pruned_parameters(trainer, pl_module, self.module_names)
            self.prepare(pl_module, trainer)
            repoint_pruning(pl_module, pruned, self.engine, self.targets)

        pl_module.configure_model = configure_model_then_prepare  # type: ignore[method-assign]

    def _refuse_combinations(self, trainer: "pl.Trainer") -> None:
        """Trainer settings QAT cannot honour, refused before any step with the reason."""
        errors = []
        precision = getattr(trainer, "precision", "32-true")
        if precision not in FLOAT32_PRECISIONS:
            errors.append(
                f"Trainer(precision={precision!r}): QAT's fake-quant ops (torch.ao's fused_moving_avg_obs_fake_quant, "
                "torchao's fake-quant) compute scales in float32 and fail or go wrong under autocast; train with "
                "precision='32-true' (the int8 model runs in int8 regardless)"
            )
        for callback in trainer.callbacks:
            if isinstance(callback, EMAWeightAveraging):
                errors.append(
                    "EMAWeightAveraging: it averages every parameter and buffer of the model, observer statistics, "
                    "scales and zero points included, and swaps the averages in for validation, which breaks the "
                    "fake-quant state (and would ship averaged scales); remove it, or average only the float run "
                    "before QAT"
                )
            elif isinstance(callback, StochasticWeightAveraging) and self.schedule.bn_freeze is not None:
                errors.append(
                    "StochasticWeightAveraging with bn_freeze: SWA recomputes BatchNorm statistics for the averaged "
                    "weights in an extra pass, which bn_freeze prevents, so the averaged model keeps statistics of "
                    "other weights (measured: int8 21.5 % vs 98.5 %); set bn_freeze=None or drop SWA"
                )
        if compile_mode(self.spec.options) == "on" and trainer.world_size > 1:
            errors.append(
                f"engine_options.compile=on with {trainer.world_size} processes: the compiled training path is "
                "single-process for now; use compile=auto (it stays eager there) or off"
            )
        if errors:
            raise ConfigError(errors)

    def _resolve_schedule(self, trainer: "pl.Trainer") -> None:
        """The default schedule from the run's length, and milestones the run never reaches refused."""
        try:
            total = float(trainer.estimated_stepping_batches)
        except Exception:  # no train loader here (e.g. prepare-only flows): nothing to derive or check
            return
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        per_epoch = total / epochs if epochs and (trainer.max_steps is None or trainer.max_steps < 0) else None
        if per_epoch is None and trainer.num_training_batches not in (None, float("inf")):
            per_epoch = trainer.num_training_batches / max(1, trainer.accumulate_grad_batches)
        limits = f"max_epochs={trainer.max_epochs}, max_steps={trainer.max_steps}"
        if self.auto_schedule is not None:
            if total == float("inf"):
                raise ConfigError(
                    f"fake_quant_start/observer_freeze/bn_freeze='auto': the fit has no end ({limits}), so the "
                    "schedule cannot be derived from its length; give milestones, e.g. fake_quant_start={'step': 1000}"
                )
            self.schedule = self.auto_schedule.resolve(int(total))
            rank_zero_info(f"[qlightning] schedule {self.auto_schedule.describe()}: {int(total)} steps -> "
                           f"fake-quant from {self.schedule.fake_quant_start}, freeze at {self.schedule.observer_freeze}")
            return
        problems = unreachable(self.schedule, total, per_epoch, limits)
        if problems:
            raise ConfigError(problems)

    def _wrap_on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        """Check a checkpoint's QAT state before Lightning loads its weights (and, outside fit, prepare for it)."""
        original_on_load = pl_module.on_load_checkpoint

        def on_load_checkpoint_checked(checkpoint: dict[str, Any]) -> None:
            pl_module.__dict__.pop("on_load_checkpoint", None)
            original_on_load(checkpoint)
            states = {k: v for k, v in checkpoint.get("callbacks", {}).items() if str(k).startswith(type(self).__name__)}
            if not states:
                return
            self._check_checkpoint_state(states)
            if stage == "fit":
                return
            if self.converted:  # e.g. test(ckpt_path="best") after a fit: the checkpoint holds fake-quant weights
                for name, module in self.fake_quant_modules.items():
                    set_submodule(pl_module, name, copy.deepcopy(module))
                self.converted = False
            self.prepare(pl_module, trainer)
            saved = self._state_of(states)
            phase = saved.get("phase") if saved else None
            if phase is not None and not phase.get("fake_quant"):
                self._convert_after_load = False
                notice = (f"{stage}: the checkpoint was saved before fake-quant started (step "
                          f"{checkpoint.get('global_step')}), so its scales were never trained; evaluating its "
                          "float model (quantization off), not an int8 conversion of it")
                self.notices.append(notice)
                rank_zero_warn(f"[qlightning] {notice}")
                return
            self._convert_after_load = self.convert_on_fit_end

        pl_module.on_load_checkpoint = on_load_checkpoint_checked  # type: ignore[method-assign]

    def _state_of(self, states: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
        """This callback's entry among a checkpoint's QAT states (the only one, when the key differs)."""
        if self.state_key in states:
            return states[self.state_key]
        if len(states) == 1:
            return next(iter(states.values()))
        return None  # several QAT callbacks saved state: each checks its own entry in load_state_dict

    def _check_checkpoint_state(self, states: Mapping[str, Any]) -> None:
        """A checkpoint trained with another backend, engine or module list is an error naming both values."""
        state = self._state_of(states)
        if state is None:
            return
        problems = []
        for key, mine in (("backend", self.backend), ("engine", self.engine.name)):
            theirs = state.get(key)
            if theirs is not None and theirs != mine:
                problems.append(f"{key}={mine!r}: the checkpoint was trained with {key} {theirs!r}; "
                                f"resume with {key}={theirs!r} or start a new fit")
        saved = state.get("modules")
        if saved and self.targets and list(saved) != list(self.targets):
            problems.append(f"modules: the checkpoint was trained with quantized modules {list(saved)}, "
                            f"this run prepares {list(self.targets)}")
        elif saved and not self.targets and sorted(saved) != sorted(self.module_names) and self.state_key not in states:
            problems.append(f"modules={self.module_names}: the checkpoint was trained with quantized modules {list(saved)}")
        if problems:
            raise ConfigError(problems)

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # drop hook wrappers that were never called (no checkpoint loaded): a LightningModule must
        # stay picklable and free of references to this callback
        for hook in ("configure_model", "on_load_checkpoint"):
            pl_module.__dict__.pop(hook, None)

    def prepare(self, pl_module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None) -> None:
        """Prepare every target submodule of ``pl_module`` in place (idempotent).

        Called by the Trainer; call it yourself to rebuild a fake-quant model without a Trainer.

        Args:
            pl_module: the LightningModule whose target submodules to prepare.
            trainer: its Trainer, if any: one of its training batches gives example inputs when nothing else does.
        """
        if self.prepared:
            return
        self.engine  # resolved before the session uses it
        self.session.prepare(pl_module, compat.first_training_batch(trainer) if trainer is not None else None)
        self._say_engine_notes()
        self.session.apply_phase(pl_module, self.schedule.phase(0, 0))
        self.session.set_observers(pl_module, False)
        processes = trainer.world_size if trainer is not None else 1
        self._compiler = CompileDecider(compile_mode(self.spec.options), self.engine.compiles_training, processes)
        if not self._compiler.pending:
            self._settle_compile(pl_module)
        if self.auto_schedule is not None and self.schedule.fake_quant_start == _AUTO_PENDING:
            schedule = "schedule: derived from the run's length when training starts"  # not the placeholder's step 2**62
        else:
            schedule = (f"schedule: fake-quant from {self.schedule.fake_quant_start or 'step 0'}, "
                        f"observers freeze at {self.schedule.observer_freeze or 'never'}, "
                        f"BN freezes at {self.schedule.bn_freeze or 'never'}")
        rank_zero_info(
            f"[qlightning] prepared {self.targets} for QAT ({self.engine.name} engine, {self.backend} backend); {schedule}"
        )

    def _settle_compile(self, pl_module: "pl.LightningModule") -> None:
        """Record the compile choice (report, log) and compile the targets' training forwards if it says so."""
        choice = self._compiler.choice
        self.session.compile_choice = choice.to_dict()
        if choice.compiled:
            self.session.compile_training(pl_module)
        if choice.mode != "off":
            rank_zero_info(f"[qlightning] {choice.describe()}")

    def _time_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """``engine_options.compile=auto``: time eager steps, then decide once (core/compile_choice.py)."""
        self._compiler.add_step(time.perf_counter() - self._step_started)
        self._step_started = None
        if not self._compiler.ready():
            return
        try:
            left: Optional[float] = float(trainer.estimated_stepping_batches) - trainer.global_step
        except Exception:  # no known length
            left = None
        self._compiler.decide(left, phases_left(self.schedule, trainer.global_step, trainer.current_epoch),
                              self.session.fake_quant_count(pl_module))
        self._settle_compile(pl_module)

    # ------------------------------------------------------------------ schedule

    def _apply(self, pl_module: "pl.LightningModule", phase: Phase) -> None:
        self.session.apply_phase(pl_module, phase)

    def _set_observers(self, pl_module: "pl.LightningModule", enabled: bool) -> None:
        self.session.set_observers(pl_module, enabled)

    @override
    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # after a checkpoint restore and with the loaders built: reading estimated_stepping_batches in
        # configure_model would build the train loader before its state is restored (mid-epoch resume)
        if self.prepared and not self.converted:
            self._resolve_schedule(trainer)

    @override
    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ) -> None:
        if not self.prepared or self.converted:
            return
        phase = self.schedule.phase(trainer.global_step, trainer.current_epoch)
        changed = phase != self.phase
        if changed:
            rank_zero_info(
                f"[qlightning] step {trainer.global_step} (epoch {trainer.current_epoch}): {phase.describe()}"
            )
            self.phase = phase
        if phase.fake_quant and self.float_snapshot is None and self.keep_float_snapshot:
            self.session.take_float_snapshot(pl_module, step=trainer.global_step)
            if self.ptq_batches and not self.ptq_modules:
                self._run_ptq_baseline(trainer, pl_module)  # before fake-quant is applied: float weights
        if trainer.loggers:
            self._log_phase(trainer, pl_module, phase, changed or batch_idx == 0)
        # applied every batch: Lightning's model.train() after validation resets BatchNorm modes
        self._apply(pl_module, phase)
        if self._compiler is not None and self._compiler.pending:
            self._step_started = time.perf_counter()

    def _log_phase(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", phase: Phase, changed: bool
    ) -> None:
        """``qat/*`` metrics: the phase flags and (on logging steps) the activation scales.

        ``LightningModule.log`` costs ~0.5-1 ms a call and the loggers see a step's values only every
        ``log_every_n_steps``: the flags are logged when they change, at each epoch's first batch (Lightning
        keeps a step metric's last value until the epoch ends) and on the steps the loggers write, so what
        reaches them is what per-step logging gave; the scales only on those steps.
        """
        writes = (trainer.global_step + 1) % max(1, trainer.log_every_n_steps) == 0
        if changed or writes:
            for key in Phase.FLAGS:
                pl_module.log(f"qat/{key}", float(getattr(phase, key)), on_step=True, on_epoch=False)
        if writes:
            # activation scales over training: the report plots their evolution
            for name in self.targets:
                for key, q in self.engine.describe_qparams(pl_module.get_submodule(name)).items():
                    if "weight_fake_quant" not in key:
                        pl_module.log(f"qat/scale/{name}.{key}", q["scale_mean"], on_step=True, on_epoch=False)

    def _run_ptq_baseline(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", states: Optional[dict[str, Any]] = None
    ) -> None:
        """PTQ of the float weights (live, or ``states`` saved at fake-quant start) on training batches."""
        with RandomStates():
            batches = calibration_batches(trainer, "train", self.ptq_batches)
        inputs = collect_inputs(pl_module, self.targets, batches, "train", trainer)
        self.session.build_ptq_baseline(pl_module, inputs, self.ptq_qconfig_mapping, states)
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
            if self._compiler is not None and self._compiler.pending and self._step_started is not None:
                self._time_step(trainer, pl_module)

    def _evaluation(self, pl_module: "pl.LightningModule", stage: str, start: bool) -> None:
        if start and self._convert_after_load and self.prepared and not self.converted:
            # trainer.validate/test/predict(ckpt_path=...): evaluate what would ship, the int8 model
            self._convert_after_load = False
            self.session.set_observers(pl_module, False)
            self.convert(pl_module)
            rank_zero_info(f"[qlightning] {stage}: evaluating the int8 model converted from the checkpoint "
                           "(convert_on_fit_end=False evaluates the fake-quant model)")
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
        if self.convert_on_fit_end and self.prepared and not self.converted:
            self._complete_schedule(trainer, pl_module)
            if (self.fidelity.enabled or self.lowering != ENGINE_MODULE) and trainer.is_global_zero:
                self._hold_batches(trainer, pl_module)  # the fidelity gate's and the lowering's real data
        self._sync(trainer, pl_module)
        if self.ptq_batches and not self.ptq_modules and self.float_snapshot is not None and self.prepared:
            self._run_ptq_baseline(trainer, pl_module, self.float_snapshot)  # resumed after fake-quant start
        if self.convert_on_fit_end and self.prepared and not self.converted:
            if is_distributed(trainer):
                self._convert_on_rank_zero(trainer, pl_module)
            else:
                self.convert(pl_module)
                self._gate(pl_module)
        if self.prepared and compat.spawn_start_method(trainer) is not None and trainer.is_global_zero:
            self._send_to_main_process(trainer, pl_module)

    def _complete_schedule(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """A fit that ended before fake-quant started: calibrate first (or refuse), and say so."""
        if self.phase is not None and self.phase.fake_quant:
            return
        start = self.schedule.fake_quant_start
        message = (
            f"QuantizationAwareTraining: the fit ended at step {trainer.global_step} (epoch {trainer.current_epoch}) "
            f"before fake-quant started ({start}), so the model was never trained against quantization and "
            "its scales were never computed"
        )
        if self.on_incomplete_schedule == "error":
            raise IncompleteScheduleError(
                message + "; train until the schedule's fake_quant_start, move it earlier, or pass "
                "on_incomplete_schedule='calibrate' to calibrate on training batches and convert anyway"
            )
        phase = Phase(fake_quant=True, observe=True, bn_frozen=True)
        for module in self.session.modules(pl_module).values():
            self.engine.reset_observers(module)  # ranges averaged while the weights still moved are stale
        self.session.apply_phase(pl_module, phase)
        count = 0
        with RandomStates():
            for i, batch in enumerate(calibration_batches(trainer, "train", self.calibration_batches)):
                batch = compat.to_module_device(batch, pl_module, trainer)
                run_to_targets(pl_module, self.targets, lambda: pl_module.training_step(batch, i))
                count += 1
        self.session.set_observers(pl_module, False)
        self.phase = Phase(fake_quant=True, observe=False, bn_frozen=True)
        self.session.apply_phase(pl_module, self.phase)
        notice = message + f"; calibrated observers on {count} training batches before converting (post-training quantization, not QAT)"
        self.notices.append(notice)
        rank_zero_warn(f"[qlightning] {notice}")

    def _hold_batches(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Inputs of each target on held batches (validation first), captured before converting."""
        for source, words in (("val", "validation batches"), ("train", "training batches")):
            try:
                with RandomStates():
                    batches = list(calibration_batches(trainer, source, self.fidelity.batches))
                held = collect_inputs(pl_module, self.targets, batches, source, trainer)
            except Exception:
                continue
            if all(held.get(name) for name in self.targets):
                self._held_batches, self._held_source = held, f"{len(batches)} {words}"
                return
        self._held_batches = {name: [self.inputs[name]] for name in self.targets}
        self._held_source = "the captured example inputs"

    def _gate(self, pl_module: "pl.LightningModule") -> None:
        """Fit end: the int8 model as it runs against the fake-quant model; fail, warn or fall back."""
        if not self.fidelity.enabled or not self.fake_quant_modules:
            self._held_batches = {}
            return
        breaches: list[ModuleFidelity] = []
        for name in self.targets:
            fake_quant = self.fake_quant_modules.get(name)
            if fake_quant is None:
                continue
            if self.engine.takes_quantized_inputs(self.spec):
                # its inputs are int8 tensors another quantized module makes: the module alone has no
                # float input to compare on (qlightning train's parity gate compares the whole model)
                self.fidelity_results[name] = {"module": name, "passed": True, "action": "not compared: takes int8 inputs"}
                continue
            result = compare_modules(
                name, fake_quant, pl_module.get_submodule(name), self._held_batches.get(name) or [self.inputs[name]],
                self.fidelity.min_sqnr_db, self.fidelity.min_top1_agreement, self._held_source or "example inputs",
            )
            fall_back = lambda: set_submodule(pl_module, name, copy.deepcopy(fake_quant))  # noqa: E731
            self._record_comparison(result, breaches, apply_on_breach(result, self.fidelity, fall_back, "fake-quant"))
        self._held_batches = {}
        self._conclude_gate(breaches, "the fake-quant model that trained", fallback="keeps the fake-quant module")

    def convert(self, pl_module: "pl.LightningModule") -> None:
        """Convert every prepared submodule to int8 for the backend, in place.

        Args:
            pl_module: the LightningModule whose prepared submodules to convert.
        """
        self.engine  # resolved before the session uses it
        self.session.convert(
            pl_module, self.lowering, self.lowering_candidates, self.lowering_batch_size, self.lowering_min_sqnr_db,
            on_choice=self._log_choice, held=self._held_batches, held_source=self._held_source,
        )
        rank_zero_info(f"[qlightning] converted {self.targets} to int8 ({self.backend})")

    def _log_choice(self, name: str, choice: Any) -> None:
        rank_zero_info(
            f"[qlightning] {name}: lowering={self.lowering} kept {choice.name!r} "
            f"(median ms at batch {choice.batch_size}: {choice.latency_ms}; SQNR dB vs fake-quant on "
            f"{choice.parity_on}: {choice.sqnr_db}"
            + (f"; not eligible: {choice.errors}" if choice.errors else "") + ")"
        )

    def __getstate__(self) -> dict[str, Any]:
        # Pickled copies (the processes a spawn strategy starts for a validate/test/predict after a
        # spawn fit) carry the model's state but not the fake-quant copies kept for reports and
        # lowering: FX-prepared modules do not pickle, and those processes never use them.
        state = self.__dict__.copy()
        engine = engine_class(self._engine_arg)
        if engine is not None and engine.pickles_without_prepared:
            session = copy.copy(self.session)
            session.fake_quant_modules = {}
            state["session"] = session
        return state

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
            "float_snapshot_step": self.session.float_snapshot_step,
            "schedule": {k: (None if m is None else {"epoch": m.epoch, "step": m.step})
                         for k, m in vars(self.schedule).items()},
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
        self.session.float_snapshot_step = state_dict.get("float_snapshot_step")
