"""QuantSession: one set of quantized submodules of a model, from float to lowered int8.

Engine-neutral and Lightning-free. It owns the targets, the spec, the captured example inputs and
every variant of each target (the float module it was prepared from, the float snapshot at
fake-quant start, the PTQ baseline, the fake-quant copy, the engine's int8 module, the lowered
runtime), and runs prepare -> phase -> calibrate -> convert -> lower behind a few calls. The
callbacks are thin Lightning adapters over it; the app, report, exports and parity gate read it.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.nn.utils import prune

from qlightning.core.inputs import Inputs, example_inputs_for, positional_args, rebatch, resolve_targets, tile_inputs
from qlightning.core.schedule import Phase
from qlightning.engines import QuantEngine, QuantSpec
from qlightning.errors import ConfigError, DryRunError, ReferenceUnavailableError, TraceError
from qlightning.quantize.calibration import float_module_from
from qlightning.quantize.lowering import BUILDERS, CANDIDATES, ENGINE_MODULE, LoweringChoice, LoweringContext, choose_lowering
from qlightning.quantize.ptq import ptq_baseline


def set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at ``name`` inside ``root`` (index assignment inside Sequential/ModuleList).

    Args:
        root: the model.
        name: the dotted name of the submodule to replace.
        module: what to put there.
    """
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.Sequential, nn.ModuleList)) and child.isdigit():
        parent[int(child)] = module
    else:
        setattr(parent, child, module)


def has_submodule(root: nn.Module, name: str) -> bool:
    """Whether ``root`` has a submodule called ``name``.

    Args:
        root: the model.
        name: a dotted submodule name.
    """
    try:
        root.get_submodule(name)
    except AttributeError:
        return False
    return True


def remove_pruning(module: nn.Module) -> None:
    """Make ``torch.nn.utils.prune`` masks permanent, so convert reads the pruned weights.

    Args:
        module: a module that may hold pruning reparametrizations.
    """
    for sub in module.modules():
        for hook in list(sub._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(sub, hook._tensor_name)


def session_of(owner: Any) -> "QuantSession":
    """The :class:`QuantSession` itself, or the one a quantization callback adapts (``callback.session``).

    Args:
        owner: a :class:`QuantSession` or a quantization callback.
    """
    return owner if isinstance(owner, QuantSession) else owner.session



def trace_routes(name: str, module: nn.Module, inputs: Inputs) -> str:
    """What ``qlightning doctor`` would say about a target FX could not trace, for its error: where tracing stops
    and the ``modules`` list of the parts that trace (route 1.a), names as the callback takes them; ``""`` when
    the diagnosis finds nothing to add.

    Args:
        name: the target's name in the LightningModule.
        module: the float target.
        inputs: its example inputs.
    """
    from qlightning.quantize.doctor import BREAKERS, compress, diagnose

    try:
        report = diagnose(module, example_inputs=inputs)
    except Exception:  # noqa: BLE001 - the diagnosis is a hint; the trace error stands on its own
        return ""
    text = ""
    stop = next((f for f in report.findings if not f.traces and f.breaks_itself and f.location), None)
    if stop is not None:
        where = f"{name}.{stop.name}" if stop.name else name
        why = BREAKERS.get(stop.kind or "", stop.error or stop.kind)
        text += f" FX stops in {where} ({stop.cls.rsplit('.', 1)[-1]}): {why} at {stop.location}."
    parts = report.traceable_modules()
    if parts:
        universe = [f"{name}.{n}" for n, _ in module.named_modules() if n]
        text += f" The parts that trace (route 1.a): modules={compress([f'{name}.{p}' for p in parts], universe)}."
    return text


#: at most this many held batches (of the lowering's batch size) check each runtime's parity
PARITY_CALLS = 8


class QuantSession:
    """The quantization of chosen submodules of one model, through one engine.

    Args:
        engine: the engine that prepares and converts (``fx``, ``pt2e``, or another
            :class:`~qlightning.engines.QuantEngine`).
        spec: how to quantize (backend, qconfig mapping, custom configs, engine options).
        module_names: names or glob patterns of the submodules to quantize, each on its own.
        example_inputs: ``{name: Inputs}`` used instead of capturing inputs from the model.
        keep_fake_quant: keep a copy of each fake-quant module when converting (the fidelity
            reference of lowering, exports and the parity gate).
        keep_float_refs: keep a reference to each float module before preparation (needed to
            rebuild float copies, e.g. for the PTQ baseline).
        kind: ``"qat"`` or ``"ptq"``: what the report compares (a PTQ run has no fake-quant model).

    Example::

        session = QuantSession(get_engine("fx"), QuantSpec(backend="x86"), ["net"])
        session.prepare(model)                  # model.net is now fake-quant
        session.apply_phase(model, Phase(fake_quant=True, observe=True, bn_frozen=False))
        ...                                     # train
        session.convert(model)                  # model.net is now int8
    """

    def __init__(
        self,
        engine: QuantEngine,
        spec: QuantSpec,
        module_names: Sequence[str],
        example_inputs: Optional[Mapping[str, Inputs]] = None,
        keep_fake_quant: bool = True,
        keep_float_refs: bool = False,
        kind: str = "qat",
    ) -> None:
        #: ``"qat"`` (trained fake-quant) or ``"ptq"`` (calibrated only)
        self.kind = kind
        self.engine = engine
        self.spec = spec
        self.module_names = list(module_names)
        self.example_inputs = dict(example_inputs or {})
        self.keep_fake_quant = keep_fake_quant
        self.keep_float_refs = keep_float_refs
        self.targets: list[str] = []
        self.inputs: dict[str, Inputs] = {}
        self.prepared = False
        self.converted = False
        self.phase: Optional[Phase] = None
        #: the float submodules before preparation (their Parameter objects live on in the prepared ones)
        self.float_refs: dict[str, nn.Module] = {}
        #: ``{name: state_dict}`` of the prepared modules when fake-quant first turned on
        self.float_snapshot: Optional[dict[str, dict[str, torch.Tensor]]] = None
        #: the global step :attr:`float_snapshot` was taken at (``None``: not known, e.g. an older checkpoint)
        self.float_snapshot_step: Optional[int] = None
        #: float copies kept by a PTQ run (its fp32 baseline)
        self.float_modules: dict[str, nn.Module] = {}
        self.fake_quant_modules: dict[str, nn.Module] = {}
        #: a PTQ run's calibrated (observed) module of each target, kept before converting: what its
        #: q/dq reference graph (ONNX, .pt2, the parity gate's int8 reference) is built from
        self.observed_modules: dict[str, nn.Module] = {}
        #: the engine's converted module of each target (what TorchScript exports), whatever runs in its place
        self.int8_modules: dict[str, nn.Module] = {}
        #: per target, the runtime kept and every candidate's latency and parity (``lowering != "fx"``)
        self.lowering_choices: dict[str, dict[str, Any]] = {}
        #: whether training ran compiled, and why (``CompileChoice.to_dict()``); ``None`` before it is known
        self.compile_choice: Optional[dict[str, Any]] = None
        #: int8 PTQ baseline of each target
        self.ptq_modules: dict[str, nn.Module] = {}
        #: plain data saved with the model (recipe, hash, versions)
        self.provenance: dict[str, Any] = {}
        #: per target, the fit-end comparison of the int8 model with the fake-quant model (plain data)
        self.fidelity_results: dict[str, dict[str, Any]] = {}
        #: what went differently from the plan (a fit that ended before fake-quant, a fallback), in words
        self.notices: list[str] = []
        self.engine_notes: list[str] = []  # what the engine chose for the spec (QuantEngine.notes), said at prepare

    @property
    def backend(self) -> str:
        """The quantized backend of the session's spec (``spec.backend``)."""
        return self.spec.backend

    # ------------------------------------------------------------------ preparation

    def resolve(self, root: nn.Module, key: str = "modules") -> list[str]:
        """The submodule names the patterns match, checked against the spec (raises :class:`ConfigError`).

        Args:
            root: the model.
            key: the argument (or config key) the names came from, for messages.
        """
        targets = resolve_targets(root, self.module_names, key=key)
        problems = self.engine.check_spec_against_model(self.spec, {n: root.get_submodule(n) for n in targets})
        if problems:
            raise ConfigError(problems)
        return targets

    def capture(self, root: nn.Module, batch_source: Optional[Callable[[], Any]] = None) -> dict[str, Inputs]:
        """Example inputs of each target: given ones, else ``example_input_array``, else one batch.

        Args:
            root: the model.
            batch_source: returns one training batch, used when nothing else gives inputs.
        """
        self.inputs = example_inputs_for(root, self.targets, batch_source=batch_source, configured=self.example_inputs)
        return self.inputs

    def prepare(self, root: nn.Module, batch_source: Optional[Callable[[], Any]] = None) -> None:
        """Prepare every target of ``root`` in place (idempotent); observers start switched off.

        Args:
            root: the model.
            batch_source: returns one training batch, used when nothing else gives inputs.
        """
        if self.prepared:
            return
        self.targets = self.resolve(root)
        self.capture(root, batch_source)
        for name in self.targets:
            float_module = root.get_submodule(name)
            if self.keep_float_refs:
                self.float_refs[name] = float_module
            try:
                prepared = self.engine.prepare(float_module, self.inputs[name], self.spec)
            except TraceError as exc:
                raise TraceError(f"{name}: {exc}{trace_routes(name, float_module, self.inputs[name])}") from exc
            set_submodule(root, name, prepared)
        self.prepared = True

    def modules(self, root: nn.Module) -> dict[str, nn.Module]:
        """The target submodules as they are in ``root`` now.

        Args:
            root: the model.
        """
        return {name: root.get_submodule(name) for name in self.targets}

    def dry_run(self, root: nn.Module, batch_source: Optional[Callable[[], Any]] = None) -> None:
        """Prepare -> one quantized forward -> convert -> one int8 forward of every target, on a copy of ``root``.

        What a run would do at fit start and fit end, in seconds and before any training step, so that
        an engine's refusal (a qconfig mapping torch.ao cannot fuse, a custom module it cannot convert)
        is known up front. ``root`` and this session are left untouched. Raises :class:`DryRunError`
        (stage, target, the engine's exception); :class:`ConfigError` and trace errors pass as they are.

        Args:
            root: the model (copied, never changed).
            batch_source: returns one training batch, used when nothing else gives inputs.
        """
        trial = QuantSession(self.engine, self.spec, self.module_names, self.example_inputs, keep_fake_quant=False, kind=self.kind)
        copy_ = copy.deepcopy(root)
        trial.targets = trial.resolve(copy_)
        trial.capture(copy_, batch_source)
        phase = Phase(fake_quant=self.kind == "qat", observe=True, bn_frozen=False)
        for name in trial.targets:
            stage = "prepare"
            try:
                prepared = self.engine.prepare(copy_.get_submodule(name), trial.inputs[name], self.spec)
                set_submodule(copy_, name, prepared)
                stage = "forward"
                self.engine.set_phase(prepared, phase)
                with torch.no_grad():  # two rows: BatchNorm in training mode needs more than one value per channel
                    prepared(*positional_args(prepared, tile_inputs(trial.inputs[name], 2)))
                stage = "convert"
                self.engine.set_observers(prepared, False)
                int8 = self.engine.convert(prepared, self.spec)
                stage = "int8 forward"
                if not self.engine.takes_quantized_inputs(self.spec):  # float example inputs would not fit
                    with torch.no_grad():
                        int8(*positional_args(int8, trial.inputs[name]))
            except (ConfigError, TraceError):
                raise
            except Exception as exc:  # the engine's (torch.ao / torchao) own exception, whatever its type
                raise DryRunError(stage, name, exc) from exc

    # ------------------------------------------------------------------ phases

    def apply_phase(self, root: nn.Module, phase: Phase) -> None:
        """Fake-quant, observers and BatchNorm of every target as ``phase`` says.

        Args:
            root: the model.
            phase: the schedule's phase.
        """
        for module in self.modules(root).values():
            self.engine.set_phase(module, phase)

    def compile_training(self, root: nn.Module) -> bool:
        """Training forwards of every target through the engine's compiled path; False where it has none.

        Args:
            root: the model.
        """
        return all([self.engine.compile_training(module) for module in self.modules(root).values()])

    def fake_quant_count(self, root: nn.Module) -> int:
        """How many fake-quants the targets hold (what a compile of their training forwards grows with).

        Args:
            root: the model.
        """
        return sum(len(self.engine.describe_qparams(module)) for module in self.modules(root).values())

    def set_observers(self, root: nn.Module, enabled: bool) -> None:
        """Observer updates of every target on or off (nothing else changes).

        Args:
            root: the model.
            enabled: whether observers update.
        """
        for module in self.modules(root).values():
            self.engine.set_observers(module, enabled)

    def take_float_snapshot(self, root: nn.Module, step: Optional[int] = None) -> None:
        """Keep the current weights of every target: the float model the fake-quant phase starts from.

        Args:
            root: the model holding the prepared targets.
            step: the global step it is taken at (the report names it).
        """
        self.float_snapshot_step = step
        self.float_snapshot = {
            name: {k: v.detach().clone() for k, v in module.state_dict().items()} for name, module in self.modules(root).items()
        }

    def quant_state(self, root: nn.Module) -> dict[str, torch.Tensor]:
        """Every observer / fake-quant buffer of every target, by ``<target>.<buffer>``.

        Args:
            root: the model.
        """
        return {f"{name}.{k}": v for name, m in self.modules(root).items() for k, v in self.engine.quant_state(m)}

    # ------------------------------------------------------------------ PTQ baseline

    def build_ptq_baseline(
        self, root: nn.Module, inputs: Mapping[str, Sequence[Inputs]], qconfig_mapping: Any = None,
        states: Optional[Mapping[str, Any]] = None,
    ) -> None:
        """PTQ of each target's float weights (live, or ``states`` saved at fake-quant start) on ``inputs``.

        Args:
            root: the model (its prepared targets give the live weights).
            inputs: calibration inputs per target.
            qconfig_mapping: the PTQ mapping; ``None``: the PTQ counterpart of the spec's.
            states: each target's state dict saved at fake-quant start, used instead of the live weights.
        """
        for name in self.targets:
            state = None if states is None else states[name]
            float_module = float_module_from(self.float_refs[name], root.get_submodule(name), state)
            self.ptq_modules[name] = ptq_baseline(
                float_module, inputs[name], self.spec, engine=self.engine, qconfig_mapping=qconfig_mapping
            )

    # ------------------------------------------------------------------ conversion

    def detach_fake_quant(self, root: nn.Module, name: str) -> nn.Module:
        """Before converting ``name``: observers off, a fake-quant copy kept, pruning masks folded in.

        Args:
            root: the model.
            name: the target about to be converted.
        """
        prepared = root.get_submodule(name)
        self.engine.decompile(prepared)  # eager from here on: the copy and the int8 model must pickle and deepcopy
        self.engine.set_observers(prepared, False)
        if self.keep_fake_quant:
            self.fake_quant_modules[name] = copy.deepcopy(prepared).eval()
        remove_pruning(prepared)
        return prepared

    def convert(
        self,
        root: nn.Module,
        lowering: str = "fx",
        candidates: Optional[Sequence[str]] = None,
        batch_size: int = 32,
        min_sqnr_db: float = 25.0,
        on_choice: Optional[Callable[[str, LoweringChoice], None]] = None,
        held: Optional[Mapping[str, Sequence[Inputs]]] = None,
        held_source: str = "",
    ) -> None:
        """Convert every target to int8 in place; with ``lowering != "fx"`` also choose its runtime.

        Args:
            root: the model holding the prepared targets.
            lowering: ``fx`` (the engine's module), ``auto`` or a runtime name of
                :data:`~qlightning.quantize.lowering.CANDIDATES`.
            candidates: the runtimes ``auto`` chooses from (default: all).
            batch_size: the batch size runtimes are timed and checked at.
            min_sqnr_db: parity a runtime needs against the fake-quant model.
            on_choice: called with each target's choice (for logging).
            held: each target's inputs on held data (e.g. validation batches), on which the runtimes'
                parity is measured, regrouped into batches of ``batch_size``; else the example input tiled.
            held_source: what ``held`` is, in words (for the report).
        """
        for name in self.targets:
            prepared = self.detach_fake_quant(root, name)
            int8 = self.engine.convert(prepared, self.spec)
            self.int8_modules[name] = int8
            set_submodule(root, name, int8)
            if lowering != ENGINE_MODULE and name in self.fake_quant_modules:
                set_submodule(root, name, self.lower(
                    name, int8, lowering, candidates, batch_size, min_sqnr_db, on_choice,
                    parity_inputs=(held or {}).get(name), parity_source=held_source,
                ))
        self.converted = True

    def export_limits(self) -> dict[str, str]:
        """The exports (``onnx``, ``pt2``) and the q/dq ``reference`` this session's modules cannot have, with why."""
        return self.engine.export_limits(self.spec)

    def reference_module(self, name: str) -> nn.Module:
        """The q/dq graph that computes what the int8 module ``name`` computes (exports, lowering).

        Args:
            name: a converted target.
        """
        limit = self.export_limits().get("reference")
        if limit is not None:
            raise ReferenceUnavailableError(f"{name}: no q/dq reference graph: {limit}")
        prepared = self.fake_quant_modules.get(name, self.observed_modules.get(name))
        if prepared is None and not self.engine.converts_to_qdq_graph:
            how = ("a PTQ run keeps it only for static quantization (mode='static')" if self.kind == "ptq" else
                   "construct QuantizationAwareTraining with keep_fake_quant=True (the default)")
            raise ConfigError(
                f"{name}: ONNX and .pt2 exports (and the parity gate's int8 reference) are built from the prepared "
                f"module before conversion, which was not kept; {how}"
            )
        int8 = self.int8_modules.get(name)
        if int8 is None:
            raise ConfigError(f"{name}: not converted by this session, so it has no q/dq reference")
        return self.engine.reference_module(prepared, int8, self.spec)

    def lower(
        self, name: str, int8: nn.Module, lowering: str, candidates: Optional[Sequence[str]] = None,
        batch_size: int = 32, min_sqnr_db: float = 25.0,
        on_choice: Optional[Callable[[str, LoweringChoice], None]] = None,
        parity_inputs: Optional[Sequence[Inputs]] = None,
        parity_source: str = "",
    ) -> nn.Module:
        """The fastest runtime of ``int8`` that is faithful to the fake-quant model (else ``int8``).

        Args:
            name: the target.
            int8: its converted module.
            lowering: ``auto`` or a candidate's name.
            candidates: the runtimes ``auto`` chooses from (default: all).
            batch_size: the batch size candidates are timed and checked at.
            min_sqnr_db: the SQNR a runtime needs against the fake-quant model.
            on_choice: called with the target's name and the choice (for logging).
            parity_inputs: the target's inputs on held data: regrouped into (at most
                :data:`PARITY_CALLS`) batches of ``batch_size``, the runtimes are timed on the first and
                checked on all. ``None``: the example input tiled to ``batch_size`` (an
                ``example_input_array`` of zeros gives every row the same output, so top-1 agreement
                would be all or nothing).
            parity_source: what ``parity_inputs`` are, in words (for the report).
        """
        if not candidates:
            candidates = CANDIDATES if lowering == "auto" else ("fx", lowering)
        calls = rebatch(parity_inputs, batch_size, limit=PARITY_CALLS) if parity_inputs else []
        batch = calls[0] if calls else tile_inputs(self.inputs[name], batch_size)
        try:
            reference = self.reference_module(name)
        except Exception:
            reference = None  # choose_lowering builds its own
        try:
            choice = choose_lowering(
                self.fake_quant_modules[name], int8, batch, candidates=candidates,
                min_sqnr_db=min_sqnr_db, qdq_module=reference, parity_inputs=calls or None,
            )
            rows = len(calls) * batch_size
            choice.parity_on = (f"{rows} rows of {parity_source or 'held batches'} as {len(calls)} batches of {batch_size}"
                                if calls else f"the example input tiled to {batch_size} rows")
        except Exception as exc:  # the engine's module is always a valid answer
            warnings.warn(f"qlightning lowering of {name!r} failed, keeping the {self.engine.name} int8 module: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
            return int8
        self.lowering_choices[name] = choice.to_dict()
        if on_choice is not None:
            on_choice(name, choice)
        return choice.module

    def rebuild_lowered(self, name: str, int8: nn.Module, runtime: str, batch_size: int = 32) -> nn.Module:
        """The runtime ``runtime`` of ``int8`` built again, without timing (another process chose it).

        Args:
            name: the target.
            int8: its converted module.
            runtime: the runtime the other process kept.
            batch_size: the example input is tiled to this batch.
        """
        if runtime == ENGINE_MODULE:
            return int8
        try:
            reference = self.reference_module(name)
        except Exception:
            reference = None
        batch = tile_inputs(self.inputs[name], batch_size)
        return BUILDERS[runtime](LoweringContext(self.fake_quant_modules[name], int8, batch, qdq_module=reference))

    # ------------------------------------------------------------------ variants

    def variants(self, root: nn.Module) -> dict[str, dict[str, nn.Module]]:
        """The fp32, (trained_float,) (ptq,) fake-quant and int8 versions of every target, as the report compares them.

        ``fp32`` is the float copy a PTQ run kept, or (QAT) the fake-quant copy with the weights of
        :attr:`float_snapshot` and quantization switched off. ``trained_float`` (QAT with a snapshot
        only) is the fake-quant copy with quantization switched off: the QAT-trained weights computed
        in float, the reference that separates quantization error (same weights) from training drift.

        Args:
            root: the model, converted.
        """
        int8 = {n: root.get_submodule(n) for n in self.targets}
        if self.kind == "ptq":
            return {"fp32": {n: self.float_modules[n] for n in self.targets}, "int8": int8}
        fake = {name: self.fake_quant_modules[name] for name in self.targets}
        float_off = Phase(fake_quant=False, observe=False, bn_frozen=True)
        fp32, trained = {}, {}
        for name, module in fake.items():
            fp32[name] = copy.deepcopy(module).eval()
            if self.float_snapshot is not None:
                trained[name] = copy.deepcopy(module).eval()
                self.engine.set_phase(trained[name], float_off)
                fp32[name].load_state_dict(self.float_snapshot[name])
            self.engine.set_phase(fp32[name], float_off)
        for module in fake.values():
            self.engine.set_observers(module, False)
        out = {"fp32": fp32}
        if trained:
            out["trained_float"] = trained
        if self.targets and all(name in self.ptq_modules for name in self.targets):
            out["ptq"] = {name: self.ptq_modules[name] for name in self.targets}
        out.update({"fake_quant": fake, "int8": int8})
        return out

    @property
    def fp32_is(self) -> str:
        """What the report's ``fp32`` column is, in words."""
        if self.kind == "ptq":
            return "the float model before conversion"
        if self.float_snapshot is not None:
            step = "" if self.float_snapshot_step is None else f", step {self.float_snapshot_step}"
            return f"float snapshot at fake-quant start{step} (not a float baseline: the weights before QAT training)"
        return "the final weights with quantization switched off"
