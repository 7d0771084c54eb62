"""Structured configs: the typed schema of every key `qlightning train` reads.

Hydra checks each key and type against these dataclasses (typos and wrong types fail with the
full key path); :mod:`qlightning.config.validate` then checks what types cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from qlightning.callbacks.ptq import MODES, SOURCES
from qlightning.callbacks.qat import ON_INCOMPLETE, STAGES
from qlightning.config.export_schema import ExportConf, ParityConf
from qlightning.core.fidelity import ON_BREACH
from qlightning.engines import BACKENDS, ENGINES
from qlightning.quantize.lowering import CANDIDATES, ENGINE_MODULE

SCHEMA_VERSION = 1


def _choices(name: str, values: Any) -> Any:
    """A str Enum of the runtime's own table of choices (one list per choice, kept where it is used)."""
    return Enum(name, {value: value for value in values}, type=str)


EngineName = _choices("EngineName", ENGINES)
Backend = _choices("Backend", BACKENDS)
Lowering = _choices("Lowering", (ENGINE_MODULE, "auto", *(c for c in CANDIDATES if c != ENGINE_MODULE)))


class Method(str, Enum):
    """``quant.method``: quantization-aware training or post-training quantization."""

    qat = "qat"
    ptq = "ptq"


PtqMode = _choices("PtqMode", MODES)
CalibrationSource = _choices("CalibrationSource", SOURCES)


class LoggerName(str, Enum):
    """A Lightning logger ``loggers`` may list."""

    csv = "csv"
    tensorboard = "tensorboard"


Stage = _choices("Stage", STAGES)


@dataclass
class MilestoneConf:
    """A point in training: ``epoch`` or ``step`` (set one; both null = never / from the start)."""

    epoch: Optional[int] = field(default=None, metadata={"help": "reached when this epoch starts (0-based)"})
    step: Optional[int] = field(default=None, metadata={"help": "reached when this global step is about to run (0-based)"})


@dataclass
class ScheduleConf:
    """When fake-quant starts, observers freeze and BatchNorm statistics freeze."""

    auto: bool = field(default=False, metadata={"help": "derive the schedule from the run's length (float for the first half of the steps, observers frozen for the last 15 %, BatchNorm never frozen); the milestones below are then ignored"})
    fake_quant_start: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=3), metadata={"help": "when fake-quant turns on; before it, float warm-up with observers running; both null = from the start"})
    observer_freeze: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=6), metadata={"help": "when observers stop updating scales/zero points (learnable qparams are learned from here); both null = never"})
    bn_freeze: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=6), metadata={"help": "when BatchNorm running statistics freeze; both null = never"})


@dataclass
class ExampleInputConf:
    """A synthetic example input for one submodule, when neither the model nor a batch provides one."""

    shape: List[int] = field(default_factory=list, metadata={"help": "shape of a synthetic input tensor for this submodule"})
    dtype: str = field(default="float32", metadata={"help": "its torch dtype (float32, int64, ...)"})


@dataclass
class PrepareConf:
    """FX prepare custom config: what not to trace, standalone and custom modules (names relative to each quantized module)."""

    non_traceable_module_names: List[str] = field(default_factory=list, metadata={"help": "submodules (relative names) FX must not trace; they run in float inside the quantized graph"})
    non_traceable_module_classes: List[str] = field(default_factory=list, metadata={"help": "classes (dotted paths) FX must not trace"})
    standalone_module_names: List[str] = field(default_factory=list, metadata={"help": "submodules prepared and quantized as one unit with their own example inputs (captured automatically)"})
    standalone_module_classes: List[str] = field(default_factory=list, metadata={"help": "classes prepared as standalone modules"})
    float_to_observed: Dict[str, List[Dict[str, str]]] = field(default_factory=dict, metadata={"help": "custom modules per quant type (static, dynamic, weight_only): [{float: class path, observed: class path}]"})
    input_quantized_indexes: List[int] = field(default_factory=list, metadata={"help": "graph inputs that arrive already quantized"})
    output_quantized_indexes: List[int] = field(default_factory=list, metadata={"help": "graph outputs that stay quantized"})
    preserved_attributes: List[str] = field(default_factory=list, metadata={"help": "attributes kept on the prepared GraphModule"})


@dataclass
class ConvertConf:
    """FX convert custom config: observed -> quantized custom module classes per quant type."""

    observed_to_quantized: Dict[str, List[Dict[str, str]]] = field(default_factory=dict, metadata={"help": "custom modules per quant type: [{observed: class path, quantized: class path}]"})
    preserved_attributes: List[str] = field(default_factory=list, metadata={"help": "attributes kept on the converted GraphModule"})


@dataclass
class PtqConf:
    """Post-training quantization (quant.method=ptq) and the PTQ baseline of QAT runs."""

    mode: PtqMode = field(default=PtqMode.static, metadata={"help": "static (calibrated activations), dynamic or weight_only"})
    calibrate_on: CalibrationSource = field(default=CalibrationSource.train, metadata={"help": "loader whose batches calibrate the observers"})
    num_calibration_batches: int = field(default=32, metadata={"help": "calibration batches"})
    cross_layer_equalization: Any = field(default=False, metadata={"help": "data-free cross-layer equalization before PTQ: false, true or selective"})
    baseline: bool = field(default=False, metadata={"help": "QAT runs: also PTQ the float weights at fake-quant start, reported as 'ptq'"})


# the valid choices live with the code that acts on them; the schema's enums read the same tables
OnBreach = _choices("OnBreach", ON_BREACH)
OnIncomplete = _choices("OnIncomplete", ON_INCOMPLETE)


@dataclass
class FidelityConf:
    """The fit-end gate: the int8 model as it runs against the fake-quant model that trained (PTQ: the float model)."""

    enabled: bool = field(default=True, metadata={"help": "compare int8 with fake-quant outputs (PTQ: float outputs) on held batches at fit end"})
    min_sqnr_db: Optional[float] = field(default=None, metadata={"help": "minimum SQNR of the int8 outputs against the fake-quant outputs (dB); null: 20 (QAT), 10 (PTQ, against float)"})
    min_top1_agreement: float = field(default=0.98, metadata={"help": "minimum share of rows whose argmax agrees"})
    on_breach: OnBreach = field(default=OnBreach.fail, metadata={"help": "fail (exit 1), warn (keep int8, say so), fallback (ship the fake-quant module; PTQ: the float module)"})
    batches: int = field(default=4, metadata={"help": "held batches compared (validation loader, else training batches; PTQ: the first calibration batches)"})


@dataclass
class QuantConf:
    """What to quantize, how, and when."""

    method: Method = field(default=Method.qat, metadata={"help": "qat (QuantizationAwareTraining) or ptq (train in float, then PostTrainingQuantization at fit end)"})
    engine: EngineName = field(default=EngineName.fx, metadata={"help": "fx (torch.ao FX graph mode) or pt2e (torchao, torch.export based)"})
    backend: Backend = field(default=Backend.x86, metadata={"help": "int8 kernels to lower for: x86, fbgemm, qnnpack, onednn"})
    modules: List[str] = field(default_factory=lambda: ["net"], metadata={"help": "submodules of the LightningModule to quantize (names or glob patterns), each prepared and converted on its own"})
    schedule: ScheduleConf = field(default_factory=ScheduleConf, metadata={"help": "fake-quant start, observer freeze, BatchNorm freeze"})
    observe_stages: List[Stage] = field(default_factory=lambda: [Stage.train], metadata={"help": "stages in which observers update: train, validate, test, predict"})
    convert_on_fit_end: bool = field(default=True, metadata={"help": "convert to int8 when fit ends (false: keep the fake-quant model)"})
    example_inputs: Dict[str, Any] = field(default_factory=dict, metadata={"help": "{submodule: {shape: [...], dtype: float32}} (set with +quant.example_inputs.NAME=...) when neither example_input_array nor a training batch provides inputs"})
    qconfig_mapping: Optional[Any] = field(default=None, metadata={"help": "null = the backend's default QAT mapping; else {global, object_type, module_name, module_name_regex, module_name_object_type_order}, each qconfig a preset name, null (do not quantize) or {activation, weight}"})
    qconfig_presets: Dict[str, Any] = field(default_factory=dict, metadata={"help": "extra named qconfigs ({name: {activation, weight}}) usable wherever a preset name is"})
    prepare: PrepareConf = field(default_factory=PrepareConf, metadata={"help": "FX prepare custom config"})
    convert: ConvertConf = field(default_factory=ConvertConf, metadata={"help": "FX convert custom config"})
    equalization: Optional[Any] = field(default=None, metadata={"help": "input-weight equalization (FX prepare_fx, PTQ only): a list of module names or {global: true}"})
    ptq: PtqConf = field(default_factory=PtqConf, metadata={"help": "post-training quantization settings"})
    backend_config: Optional[str] = field(default=None, metadata={"help": "null = the backend's own; or x86, fbgemm, qnnpack, onednn, native, executorch"})
    engine_options: Dict[str, Any] = field(default_factory=dict, metadata={"help": "engine switches: fx: compile (auto | on | off: QAT training forwards through torch.compile; auto when it pays back), fast_qat, fast_conv_bn, fast_linear, fast_prepare, clamp_activations, trained_qparams, pool_spatial_means, pool_observers, requantize_as_trained, leaf_mode_modules (all default true); pt2e: compile (as fx), dynamic_batch, dynamic_dims, fold_quantize, fast_fold, split_call_sites, dropout_stochastic_depth, quantize_embeddings, trained_qparams, lean_float_phase. Add keys with +quant.engine_options.NAME=VALUE"})
    lowering: Lowering = field(default=Lowering.fx, metadata={"help": "int8 runtime at fit end: fx (the engine's converted module), onnxruntime, inductor, or auto (time each, keep the fastest whose output SQNR vs the fake-quant model on held validation batches passes; the choice is in report.json)"})
    lowering_candidates: List[str] = field(default_factory=list, metadata={"help": "runtimes lowering=auto tries (empty: fx, onnxruntime, inductor)"})
    lowering_batch_size: int = field(default=32, metadata={"help": "batch size lowering=auto times and checks at (held validation batches regrouped into it; else the example input tiled)"})
    lowering_min_sqnr_db: float = field(default=25.0, metadata={"help": "lowering=auto: minimum output SQNR vs the fake-quant model (or within 1 dB of the fx module's)"})
    fidelity: FidelityConf = field(default_factory=FidelityConf, metadata={"help": "the fit-end int8 vs fake-quant gate"})
    on_incomplete_schedule: OnIncomplete = field(default=OnIncomplete.calibrate, metadata={"help": "a fit that ends before fake-quant started: calibrate (on training batches, then convert, with a warning) or error"})
    calibration_batches: int = field(default=16, metadata={"help": "training batches on_incomplete_schedule=calibrate uses"})


@dataclass
class TrainerConf:
    """Arguments passed to ``lightning.pytorch.Trainer`` (a typed subset; typos fail early)."""

    max_epochs: int = field(default=8, metadata={"help": "Trainer max_epochs"})
    max_steps: int = field(default=-1, metadata={"help": "Trainer max_steps (-1: no limit)"})
    accelerator: str = field(default="cpu", metadata={"help": "cpu, gpu, auto, ..."})
    devices: Any = field(default=1, metadata={"help": "number or list of devices"})
    num_nodes: int = field(default=1, metadata={"help": "nodes for multi-node DDP"})
    strategy: str = field(default="auto", metadata={"help": "auto, ddp, ddp_spawn, ..."})
    precision: Any = field(default="32-true", metadata={"help": "Trainer precision"})
    log_every_n_steps: int = field(default=10, metadata={"help": "logging interval"})
    limit_train_batches: Optional[Any] = field(default=None, metadata={"help": "fraction or count of training batches per epoch"})
    limit_val_batches: Optional[Any] = field(default=None, metadata={"help": "fraction or count of validation batches"})
    limit_test_batches: Optional[Any] = field(default=None, metadata={"help": "fraction or count of test batches (also for the report)"})
    val_check_interval: Optional[Any] = field(default=None, metadata={"help": "validation interval within an epoch"})
    check_val_every_n_epoch: Optional[int] = field(default=1, metadata={"help": "validate every n epochs"})
    num_sanity_val_steps: int = field(default=2, metadata={"help": "sanity-check validation batches"})
    gradient_clip_val: Optional[float] = field(default=None, metadata={"help": "gradient clipping value"})
    accumulate_grad_batches: int = field(default=1, metadata={"help": "gradient accumulation"})
    enable_progress_bar: bool = field(default=True, metadata={"help": "Lightning's progress bar"})
    enable_model_summary: bool = field(default=True, metadata={"help": "model summary at fit start"})
    deterministic: Optional[Any] = field(default=None, metadata={"help": "torch deterministic algorithms (int8 kernels have none: keep null on CPU)"})
    benchmark: Optional[bool] = field(default=None, metadata={"help": "cudnn benchmark"})


@dataclass
class CheckpointConf:
    """``ModelCheckpoint`` settings; checkpoints land in ``<run dir>/checkpoints``."""

    every_n_epochs: Optional[int] = field(default=1, metadata={"help": "save a checkpoint every n epochs"})
    every_n_train_steps: Optional[int] = field(default=None, metadata={"help": "save every n training steps (mid-epoch resume)"})
    save_last: bool = field(default=True, metadata={"help": "keep checkpoints/last.ckpt"})
    save_top_k: int = field(default=1, metadata={"help": "how many periodic checkpoints to keep (-1: all)"})


@dataclass
class ReportConf:
    """The float / fake-quant / int8 comparison written after fit."""

    enabled: bool = field(default=True, metadata={"help": "evaluate fp32 / fake-quant / int8 on the test set and write report.json/md"})
    latency_batch_size: int = field(default=32, metadata={"help": "batch size of the latency measurement (real test inputs)"})
    latency_repeats: int = field(default=30, metadata={"help": "repeats; the median is reported"})
    latency_threads: Optional[int] = field(default=None, metadata={"help": "torch threads while timing (null: unchanged)"})


@dataclass
class TrainConfig:
    """The whole `qlightning train` configuration."""

    schema_version: int = field(default=SCHEMA_VERSION, metadata={"help": "version of this schema a recipe was written for"})
    seed: int = field(default=0, metadata={"help": "seeds data split, init and shuffling"})
    ckpt_path: Optional[str] = field(default=None, metadata={"help": "resume from this checkpoint: a local file, checked (weights_only=True) against the model before training"})
    allow_remote_ckpt: bool = field(default=False, metadata={"help": "let ckpt_path be a URL (downloaded, then checked like a local file); command line only, never a recipe"})
    data: Dict[str, Any] = field(default_factory=dict, metadata={"help": "_target_ data module class + its arguments"})
    model: Dict[str, Any] = field(default_factory=dict, metadata={"help": "_target_ LightningModule class + its arguments"})
    quant: QuantConf = field(default_factory=QuantConf, metadata={"help": "what to quantize, how and when"})
    trainer: TrainerConf = field(default_factory=TrainerConf, metadata={"help": "Trainer arguments (typed subset)"})
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf, metadata={"help": "ModelCheckpoint settings"})
    report: ReportConf = field(default_factory=ReportConf, metadata={"help": "the float / fake-quant / int8 report"})
    export: ExportConf = field(default_factory=ExportConf, metadata={"help": "exported artifacts"})
    parity: ParityConf = field(default_factory=ParityConf, metadata={"help": "the fake-vs-real parity gate"})
    loggers: List[LoggerName] = field(default_factory=lambda: [LoggerName.csv], metadata={"help": "Lightning loggers writing into the run folder's logs/ (csv, tensorboard: needs the tensorboard extra); they get the QAT phase, activation scales and the final report metrics"})
    trusted_modules: List[str] = field(default_factory=list, metadata={"help": "your modules whose own classes and functions a config may name, beyond the built-in set (README: Security); command line or QLIGHTNING_TRUSTED_MODULES only, never a recipe"})


def section(cfg: Any, key: str) -> Any:
    """``cfg.<key>`` merged over the schema defaults (works for a plain dict from a checkpoint too).

    Args:
        cfg: a run config (OmegaConf node or plain dict).
        key: the section's name (``export``, ``parity``, ``report``).
    """
    from omegaconf import OmegaConf

    schema = {"export": ExportConf, "parity": ParityConf, "report": ReportConf}[key]
    node = None
    if cfg is not None:
        node = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
    base = OmegaConf.structured(schema)
    merged = OmegaConf.merge(base, node) if node is not None else base
    return OmegaConf.to_container(merged, resolve=True, enum_to_str=True)


def sections(cfg: Any) -> dict[str, Any]:
    """The ``export``, ``parity`` and ``report`` sections of a run config, as plain dicts over the defaults.

    Args:
        cfg: a run config (OmegaConf node or plain dict).
    """
    return {key: section(cfg, key) for key in ("export", "parity", "report")}
