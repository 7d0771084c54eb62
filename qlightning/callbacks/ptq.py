"""PostTrainingQuantization: calibrate on N real batches and convert, as a Lightning callback.

Also :func:`ptq_baseline`, the same PTQ applied to a copy of a float module on given inputs, for
QAT runs that want a float / PTQ / QAT comparison.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from qlightning.callbacks import lightning_compat as compat
from qlightning.callbacks.base import SessionCallback, check_common_arguments
from qlightning.callbacks.calibration_data import _STEP, calibration_batches, collect_inputs
from qlightning.callbacks.distributed import broadcast_buffers, destroy_gloo_group_at_exit
from qlightning.callbacks.qat import QuantizationAwareTraining
from qlightning.core.fidelity import PTQ_FIDELITY, FidelityConfig, apply_on_breach, compare_modules
from qlightning.core.inputs import Inputs, RandomStates, as_inputs, capture_inputs, detach_shallow, evaluating, example_inputs_for, resolve_targets
from qlightning.core.session import QuantSession, set_submodule
from qlightning.engines import BACKENDS, ENGINES, QuantEngine, QuantSpec, engine_class, get_engine
from qlightning.engines.fx.qconfigs import dynamic_qconfig_mapping, quantize_dynamic_eager
from qlightning.quantize.equalization import equalized_layers
from qlightning.quantize.calibration import calibrate, calibrate_and_convert, float_module_from, run_to_targets, spec_for_ptq
from qlightning.quantize.ptq import apply_cle, equalization_mapping, ptq_baseline
from qlightning.errors import ConfigError, EngineUnavailableError, QLightningError, TraceError

MODES = ("static", "dynamic", "weight_only")
SOURCES = ("train", "val")
CLE_CHOICES = (False, True, "selective")
EQUALIZATION_CHOICES = ("all", "selective")
STATE_VERSION = 1


# ---------------------------------------------------------------------- running a step up to the targets


# ---------------------------------------------------------------------- PTQ of a module on inputs


# ---------------------------------------------------------------------- the callback


class PostTrainingQuantization(SessionCallback, Callback):
    """Post-training quantization of chosen submodules of a LightningModule, in place.

    The model is trained in float (or loaded); the callback quantizes it once, at the first of:

    * the end of ``trainer.fit`` (the float-trained weights), or
    * the start of ``trainer.validate`` / ``test`` / ``predict`` when no fit ran before (so
      ``trainer.validate(model, dm)`` calibrates, converts and then reports int8 metrics; with
      ``ckpt_path=`` the checkpoint's float weights are loaded first).

    Static mode (default) runs ``num_calibration_batches`` batches of the train (or validation)
    loader through ``training_step`` (``validation_step``) up to the quantized submodules (the
    loss, metrics and logging of the step never run), then converts and lowers for ``backend``.
    Dynamic and weight-only modes need no calibration: Linear / LSTM / GRU (and Embedding)
    layers are converted through FX (``prepare_fx`` + ``convert_fx`` with a dynamic qconfig
    mapping), or with eager ``quantize_dynamic`` when FX cannot trace the submodule.

    Args:
        modules: names or glob patterns of submodules to quantize (as for QAT).
        backend: ``"x86"``, ``"fbgemm"``, ``"qnnpack"`` or ``"onednn"``.
        engine: ``"fx"`` or ``"pt2e"`` (static mode only; dynamic modes use FX / eager torch.ao).
        mode: ``"static"`` (int8 weights and activations), ``"dynamic"`` (int8 weights,
            activations quantized per batch at run time) or ``"weight_only"`` (float16 weights
            for Linear/RNN, int8 for Embedding; float compute).
        calibrate_on: ``"train"`` or ``"val"``: the loader calibration batches come from.
        num_calibration_batches: how many (``None`` = the whole loader). Static mode only.
        qconfig_mapping: native mapping (FX ``QConfigMapping``); ``None`` = the backend's default
            PTQ mapping (static) or :func:`qlightning.engines.fx.qconfigs.dynamic_qconfig_mapping` (dynamic).
            :func:`qlightning.engines.fx.qconfigs.low_bit_qconfig_mapping` gives 4-bit weights.
        prepare_custom_config: native prepare custom config (FX ``PrepareCustomConfig``).
        convert_custom_config: native convert custom config (FX ``ConvertCustomConfig``).
        backend_config: native ``BackendConfig``; ``None`` uses the backend's own.
        example_inputs: ``{module_name: tensor | tuple | dict}`` instead of capturing them from
            ``example_input_array`` or the first calibration batch.
        equalization: FX input-weight equalization (static, fx): ``None``, ``"all"`` (every
            equalizable layer), a list of layer names, ``"selective"`` (only layers whose output
            SQNR improves; keeps the calibration inputs in memory) or a ``QConfigMapping``.
        cross_layer_equalization: ``True`` for data-free cross-layer equalization of each float
            submodule before preparing, ``"selective"`` to keep it only where per-layer weight
            SQNR improves (:mod:`qlightning.quantize.equalization`).
        dynamic_fallback: dynamic modes: ``"eager"`` (default) falls back to eager
            ``quantize_dynamic`` when FX cannot trace; ``None`` raises the trace error.
        keep_float: keep a float copy of each submodule in :attr:`float_modules`.
        engine_options: engine switches, as for QAT (``qlightning.engines.ENGINE_OPTIONS``).
        fidelity: the gate after converting: the int8 model as it runs against the float submodule
            it was calibrated from, on the first ``batches`` calibration batches (dynamic modes: the
            example inputs): output SQNR and top-1 agreement. ``True`` (default: 10 dB, since the
            quantization noise itself is measured; top-1 agreement 0.98; ``on_breach="fail"``),
            ``False``, or a mapping / :class:`~qlightning.core.fidelity.FidelityConfig`;
            ``on_breach="fallback"`` keeps the float submodule. A crashing int8 forward is a breach
            naming the op. Results are in :attr:`fidelity_results`. Each process compares on its own
            calibration batches (all convert rank 0's calibration), so with several processes a
            ``"fallback"`` could differ between them: use ``"warn"`` or ``"fail"`` there.

    Example::

        ptq = PostTrainingQuantization(modules=["net"], backend="x86", num_calibration_batches=16)
        trainer = Trainer(max_epochs=8, callbacks=[ptq])
        trainer.fit(model, datamodule=dm)     # float training, then calibrate + convert
        trainer.test(model, datamodule=dm)    # the int8 model

        # or on an already trained model:
        Trainer(callbacks=[PostTrainingQuantization(calibrate_on="val")]).validate(model, dm)
    """

    def __init__(
        self,
        modules: Union[str, Sequence[str]] = ("net",),
        backend: str = "x86",
        engine: Union[str, QuantEngine] = "fx",
        mode: str = "static",
        calibrate_on: str = "train",
        num_calibration_batches: Optional[int] = 32,
        qconfig_mapping: Any = None,
        prepare_custom_config: Any = None,
        convert_custom_config: Any = None,
        backend_config: Any = None,
        example_inputs: Optional[Mapping[str, Any]] = None,
        equalization: Any = None,
        cross_layer_equalization: Union[bool, str] = False,
        dynamic_fallback: Optional[str] = "eager",
        keep_float: bool = True,
        engine_options: Optional[Mapping[str, Any]] = None,
        fidelity: Any = True,
    ) -> None:
        errors: list[str] = []
        names = check_common_arguments(modules, backend, engine, errors)
        self.fidelity = FidelityConfig.from_value(fidelity, errors, "fidelity", defaults=PTQ_FIDELITY)
        engine_name = engine if isinstance(engine, str) else getattr(engine, "name", None)
        kind = engine_class(engine)
        if mode not in MODES:
            errors.append(f"mode={mode!r}: unknown mode; valid choices: {list(MODES)}")
        elif mode not in (kind.ptq_modes if kind is not None else ("static",)):
            errors.append(f"mode={mode!r}: dynamic and weight-only PTQ run on torch.ao (engine='fx'), got engine={engine_name!r}")
        if calibrate_on not in SOURCES:
            errors.append(f"calibrate_on={calibrate_on!r}: valid choices: {list(SOURCES)}")
        if num_calibration_batches is not None and (
            not isinstance(num_calibration_batches, int) or isinstance(num_calibration_batches, bool) or num_calibration_batches < 1
        ):
            errors.append(f"num_calibration_batches={num_calibration_batches!r}: a positive integer, or None for the whole loader")
        if not any(cross_layer_equalization is c for c in CLE_CHOICES) and cross_layer_equalization != "selective":
            errors.append(f"cross_layer_equalization={cross_layer_equalization!r}: valid choices: [False, True, 'selective']")
        if isinstance(equalization, Mapping) and not hasattr(equalization, "module_name_qconfigs"):
            # the config layer's plain-data form: {global: true} or {module_name: [...]}
            equalization = "all" if equalization.get("global") else list(equalization.get("module_name") or [])
        if equalization is not None:
            ok = (
                equalization in EQUALIZATION_CHOICES if isinstance(equalization, str)
                else isinstance(equalization, (list, tuple)) and all(isinstance(n, str) for n in equalization)
                or hasattr(equalization, "module_name_qconfigs")
            )
            if not ok:
                errors.append(
                    f"equalization={equalization!r}: valid choices: None, 'all', 'selective', a list of layer names "
                    "or a QConfigMapping of default_equalization_qconfig"
                )
            if mode in MODES and mode != "static":
                errors.append(f"equalization: only static PTQ calibrates activations; mode={mode!r}")
            if kind is None or not kind.equalizes_inputs_and_weights:
                errors.append(f"equalization: input-weight equalization is an FX feature; engine={engine_name!r}")
        if cross_layer_equalization and mode in MODES and mode != "static":
            errors.append(f"cross_layer_equalization: meant for static PTQ (Conv/Linear pairs with ReLU); mode={mode!r}")
        if dynamic_fallback not in ("eager", None):
            errors.append(f"dynamic_fallback={dynamic_fallback!r}: valid choices: ['eager', None]")
        if example_inputs is not None and not isinstance(example_inputs, Mapping):
            errors.append("example_inputs: expected a mapping {module_name: tensor | tuple | dict}")

        self.module_names = names
        self.backend = backend
        self._engine_arg = engine
        self._engine: Optional[QuantEngine] = None if isinstance(engine, str) else engine
        self.mode = mode
        self.calibrate_on = calibrate_on
        self.num_calibration_batches = num_calibration_batches
        self.equalization = equalization
        self.cross_layer_equalization = cross_layer_equalization
        self.dynamic_fallback = dynamic_fallback
        self.keep_float = keep_float
        if mode in ("dynamic", "weight_only") and qconfig_mapping is None:
            qconfig_mapping = dynamic_qconfig_mapping(mode)
        self.session = QuantSession(self._engine, QuantSpec(), names, kind="ptq")  # type: ignore[arg-type]
        self.spec = QuantSpec(
            backend=backend,
            qconfig_mapping=qconfig_mapping,
            prepare_custom_config=prepare_custom_config,
            convert_custom_config=convert_custom_config,
            backend_config=backend_config,
            is_qat=False,
            options=dict(engine_options or {}),
        )
        if not errors:
            try:  # plain-data configs (dicts, OmegaConf nodes) -> native objects, as for QAT
                self.spec = self.engine.resolve_spec(self.spec, errors)
            except EngineUnavailableError:
                pass  # raised again in setup, where the engine is needed
        if errors:
            raise ConfigError(errors)
        self.example_inputs = {k: as_inputs(v) for k, v in (example_inputs or {}).items()}
        self.session.example_inputs = self.example_inputs
        #: per target: how it was converted ("fx", "pt2e", "eager") and what equalization did
        self.details: dict[str, dict[str, Any]] = {}
        self.num_calibrated = 0
        # for the gate, between converting and comparing: the float reference and held inputs per target
        self._references: dict[str, nn.Module] = {}
        self._held: dict[str, list[Inputs]] = {}

    @property
    def engine(self) -> QuantEngine:
        if self._engine is None:
            self._engine = get_engine(self._engine_arg if self.mode == "static" else "fx")  # type: ignore[arg-type]
        self.session.engine = self._engine
        return self._engine

    @property
    def state_key(self) -> str:
        return self._generate_state_key(modules=tuple(self.module_names), backend=self.backend, mode=self.mode)

    # ------------------------------------------------------------------ when

    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        destroy_gloo_group_at_exit(trainer)
        if stage == "fit" and self.converted:
            raise QLightningError(
                "PostTrainingQuantization: the model was already quantized; fit a fresh float model "
                "(or create the callback again after reloading float weights)"
            )
        for other in trainer.callbacks:
            if isinstance(other, QuantizationAwareTraining):
                clash = [
                    (a, b) for a in self.module_names for b in other.module_names
                    if a == b or a.startswith(b + ".") or b.startswith(a + ".")
                ]
                if clash:
                    raise ConfigError(
                        f"modules={self.module_names!r}: also quantized by QuantizationAwareTraining ({clash}); "
                        "use one callback per submodule (for a PTQ baseline inside QAT see qlightning.callbacks.ptq.ptq_baseline)"
                    )
        self.engine  # fail early if the engine cannot run here

    @override
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.converted:
            self.quantize(pl_module, trainer)

    def _quantize_for_evaluation(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        if self.converted or trainer.state.fn == TrainerFn.FITTING:
            return  # validation inside fit runs the float model; fit end quantizes
        with torch.inference_mode(False):  # evaluation loops run under inference mode
            self.quantize(pl_module, trainer)

    @override
    def on_validation_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._quantize_for_evaluation(trainer, pl_module)

    @override
    def on_test_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._quantize_for_evaluation(trainer, pl_module)

    @override
    def on_predict_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._quantize_for_evaluation(trainer, pl_module)

    # ------------------------------------------------------------------ how

    def quantize(
        self,
        pl_module: "pl.LightningModule",
        trainer: Optional["pl.Trainer"] = None,
        batches: Optional[Iterable[Any]] = None,
    ) -> None:
        """Quantize every target submodule of ``pl_module`` in place (once).

        Called by the Trainer hooks; call it yourself with ``batches`` (an iterable of batches as
        the loader of ``calibrate_on`` yields them) to quantize without a Trainer.

        Args:
            pl_module: the LightningModule whose target submodules to quantize.
            trainer: its Trainer, whose loader of ``calibrate_on`` gives the calibration batches.
            batches: calibration batches to use instead of the Trainer's loader.
        """
        if self.converted:
            return
        self.targets = resolve_targets(pl_module, self.module_names, key="modules")
        check = getattr(self.engine, "check_spec_against_model", None)
        if check is not None:  # config entries (module names, types) that match nothing
            problems = check(self.spec, {n: pl_module.get_submodule(n) for n in self.targets})
            if problems:
                raise ConfigError(problems)
        if self.mode != "static":
            self._quantize_dynamic(pl_module)
        else:
            if batches is None:
                if trainer is None:
                    raise QLightningError("PostTrainingQuantization.quantize: give a trainer or calibration batches")
                with RandomStates():
                    batches = calibration_batches(trainer, self.calibrate_on, self.num_calibration_batches)
            elif self.num_calibration_batches is not None:
                batches = itertools.islice(iter(batches), self.num_calibration_batches)
            self._quantize_static(pl_module, trainer, batches)
        self.converted = True
        self._gate(pl_module)
        how = ", ".join(f"{n}: {d.get('path', self.engine.name)}" for n, d in self.details.items())
        calibrated = f", calibrated on {self.num_calibrated} {self.calibrate_on} batches" if self.mode == "static" else ""
        rank_zero_info(f"[qlightning] PTQ ({self.mode}, {self.backend}) of {self.targets} ({how}){calibrated}")

    def _quantize_dynamic(self, pl_module: "pl.LightningModule") -> None:
        for name in self.targets:
            float_module = pl_module.get_submodule(name)
            if self.keep_float or self.fidelity.enabled:
                self._references[name] = copy.deepcopy(float_module).eval()
            if self.keep_float:
                self.float_modules[name] = self._references[name]
            inputs = self.example_inputs.get(name)
            try:
                if inputs is None:
                    inputs = example_inputs_for(pl_module, [name], configured=self.example_inputs)[name]
                prepared = self.engine.prepare(float_module.eval(), inputs, self.spec)
                quantized, path = self.engine.convert(prepared, self.spec), "fx"
            except (TraceError, ConfigError) as exc:
                if self.dynamic_fallback != "eager":
                    raise
                quantized, path = quantize_dynamic_eager(float_module.eval(), self.mode), "eager"
                self.details.setdefault(name, {})["fx_problem"] = str(exc).splitlines()[0]
            if inputs is not None:
                self.inputs[name] = inputs
                self._held[name] = [inputs]
            self.details.setdefault(name, {})["path"] = path
            set_submodule(pl_module, name, quantized)

    def _quantize_static(self, pl_module: "pl.LightningModule", trainer: Optional["pl.Trainer"], batches: Iterable[Any]) -> None:
        iterator = iter(batches)
        with RandomStates():
            first = next(iterator, None)
        if first is None:
            raise QLightningError(f"PostTrainingQuantization: the {self.calibrate_on} loader yielded no batch to calibrate on")
        first = compat.to_module_device(first, pl_module, trainer)
        step = getattr(pl_module, _STEP[self.calibrate_on])
        self.inputs = self._example_inputs(pl_module, step, first)
        selective_eq = self.equalization == "selective"
        cached: dict[str, list[Inputs]] = {}
        if selective_eq:  # several PTQ trials per target: keep the calibration inputs
            rest = list(iterator)
            cached = collect_inputs(pl_module, self.targets, [first] + rest, self.calibrate_on, trainer)
            iterator = iter(())
        for name in self.targets:
            float_module = pl_module.get_submodule(name)
            if self.keep_float:
                self.float_modules[name] = copy.deepcopy(float_module).eval()
            details = self.details.setdefault(name, {"path": self.engine.name})
            float_module.eval()
            cle = apply_cle(float_module, self.cross_layer_equalization, self.spec)
            if cle is not None:
                details["cross_layer_equalization"] = cle.summary()
            eq = equalization_mapping(float_module, self.equalization, cached.get(name, []), self.spec,
                                       self.engine, details.setdefault("equalization", {}))
            if eq is None:
                details.pop("equalization", None)
            else:
                details.setdefault("equalization", {})["layers"] = equalized_layers(eq)
            spec = spec_for_ptq(self.spec, None, eq)
            self._say_engine_notes(spec)
            set_submodule(pl_module, name, self.engine.prepare(float_module, self.inputs[name], spec))
            details["spec"] = spec
        prepared = {name: pl_module.get_submodule(name) for name in self.targets}
        for module in prepared.values():
            self.engine.set_observers(module, True)
        self.num_calibrated = 0
        if selective_eq:
            for name in self.targets:
                calibrate(prepared[name], cached[name])
                self._held[name] = cached[name][: self.fidelity.batches]
            self.num_calibrated = len(cached[self.targets[0]])
        else:
            def hold(name: str, inputs: Inputs) -> None:
                if self.fidelity.enabled and len(self._held.setdefault(name, [])) < self.fidelity.batches:
                    self._held[name].append(Inputs(detach_shallow(inputs.args), detach_shallow(inputs.kwargs)))

            with RandomStates():
                for i, batch in enumerate(itertools.chain([first], (compat.to_module_device(b, pl_module, trainer) for b in iterator))):
                    ran = run_to_targets(pl_module, self.targets, lambda: step(batch, i), on_input=hold)
                    if i == 0 and len(ran) < len(self.targets):
                        missing = [t for t in self.targets if t not in ran]
                        raise QLightningError(
                            f"PostTrainingQuantization: {_STEP[self.calibrate_on]} never calls {missing}, so they "
                            "cannot be calibrated; choose the modules it runs, or calibrate_on the other loader"
                        )
                    self.num_calibrated += 1
        if trainer is not None:
            broadcast_buffers(trainer, prepared.values())  # all ranks convert rank 0's calibration
        for name, module in prepared.items():
            self.engine.set_observers(module, False)
            spec = self.details[name].pop("spec")
            # the calibrated module is what ONNX / .pt2 and the gate's int8 reference are built from
            self.session.observed_modules[name] = copy.deepcopy(module).eval()
            self._references[name] = self.session.observed_modules[name]  # observers off: the float forward
            int8 = self.engine.convert(module, spec)
            self.session.int8_modules[name] = int8
            set_submodule(pl_module, name, int8)

    def _gate(self, pl_module: "pl.LightningModule") -> None:
        """After converting: the int8 model as it runs against the float submodule; fail, warn or fall back."""
        references, held = self._references, self._held
        self._references, self._held = {}, {}
        if not self.fidelity.enabled:
            return
        breaches = []
        for name in self.targets:
            if name not in references or not held.get(name):
                self.fidelity_results[name] = {"module": name, "passed": True, "action": "not compared: no inputs held"}
                continue
            inputs = "the example inputs" if self.mode != "static" else f"{len(held[name])} {self.calibrate_on} calibration batches"
            result = compare_modules(name, references[name], pl_module.get_submodule(name), held[name],
                                     self.fidelity.min_sqnr_db, self.fidelity.min_top1_agreement, inputs, against="float")
            fall_back = lambda: set_submodule(pl_module, name, copy.deepcopy(references[name]))  # noqa: E731
            self._record_comparison(result, breaches, apply_on_breach(result, self.fidelity, fall_back, "float"))
        self._conclude_gate(breaches, "the float model it was calibrated from", fallback="keeps the float module")

    def _example_inputs(self, pl_module: "pl.LightningModule", step: Callable[..., Any], first: Any) -> dict[str, Inputs]:
        found = dict(self.example_inputs)
        missing = [t for t in self.targets if t not in found]
        if missing and getattr(pl_module, "example_input_array", None) is not None:
            try:
                found.update(example_inputs_for(pl_module, missing))
            except ConfigError:
                pass
            missing = [t for t in self.targets if t not in found]
        if missing:
            found.update(capture_inputs(pl_module, missing, lambda: step(first, 0)))
            missing = [t for t in self.targets if t not in found]
        if missing:
            raise ConfigError(
                f"example inputs: {_STEP[self.calibrate_on]} on a calibration batch never called {missing}; "
                "pass example_inputs={name: (tensor, ...)} or choose other modules"
            )
        return {t: found[t] for t in self.targets}

    # ------------------------------------------------------------------ checkpoint state

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "backend": self.backend,
            "mode": self.mode,
            "modules": list(self.targets or self.module_names),
            "converted": self.converted,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # checkpoints are written during fit, before quantization: they hold float weights, so a
        # resumed fit quantizes again at its end; nothing to restore but a consistency check
        if state_dict.get("backend") not in (None, self.backend):
            raise ConfigError(f"backend={self.backend!r}: the checkpoint was written for backend {state_dict['backend']!r}")


__all__ = [
    "PostTrainingQuantization",
    "calibrate",
    "calibrate_and_convert",
    "calibration_batches",
    "collect_inputs",
    "float_module_from",
    "ptq_baseline",
    "run_to_targets",
]
