"""Structured configs: the typed schema of every key `qlightning train` reads.

Hydra checks each key and type against these dataclasses (typos and wrong types fail with the
full key path); :mod:`qlightning.config.validate` then checks what types cannot express.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from qlightning.config.export_schema import ExportConf, ParityConf

SCHEMA_VERSION = 1


class EngineName(str, Enum):
    fx = "fx"
    pt2e = "pt2e"


class Backend(str, Enum):
    x86 = "x86"
    fbgemm = "fbgemm"
    qnnpack = "qnnpack"
    onednn = "onednn"


class Stage(str, Enum):
    train = "train"
    validate = "validate"
    test = "test"
    predict = "predict"


@dataclass
class MilestoneConf:
    """A point in training: ``epoch`` or ``step`` (set one; both null = never / from the start)."""

    epoch: Optional[int] = None
    step: Optional[int] = None


@dataclass
class ScheduleConf:
    """When fake-quant starts, observers freeze and BatchNorm statistics freeze."""

    fake_quant_start: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=3))
    observer_freeze: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=6))
    bn_freeze: MilestoneConf = field(default_factory=lambda: MilestoneConf(epoch=6))


@dataclass
class ExampleInputConf:
    """A synthetic example input for one submodule, when neither the model nor a batch provides one."""

    shape: List[int] = field(default_factory=list)
    dtype: str = "float32"


@dataclass
class PrepareConf:
    """FX prepare custom config: what not to trace, standalone and custom modules (names relative to each quantized module)."""

    non_traceable_module_names: List[str] = field(default_factory=list)
    non_traceable_module_classes: List[str] = field(default_factory=list)
    standalone_module_names: List[str] = field(default_factory=list)
    standalone_module_classes: List[str] = field(default_factory=list)
    float_to_observed: Dict[str, Dict[str, str]] = field(default_factory=dict)
    input_quantized_indexes: List[int] = field(default_factory=list)
    output_quantized_indexes: List[int] = field(default_factory=list)
    preserved_attributes: List[str] = field(default_factory=list)


@dataclass
class ConvertConf:
    """FX convert custom config: observed -> quantized custom module classes per quant type."""

    observed_to_quantized: Dict[str, Dict[str, str]] = field(default_factory=dict)
    preserved_attributes: List[str] = field(default_factory=list)


@dataclass
class QuantConf:
    """What to quantize, how, and when."""

    engine: EngineName = EngineName.fx
    backend: Backend = Backend.x86
    modules: List[str] = field(default_factory=lambda: ["net"])
    schedule: ScheduleConf = field(default_factory=ScheduleConf)
    observe_stages: List[Stage] = field(default_factory=lambda: [Stage.train])
    convert_on_fit_end: bool = True
    example_inputs: Dict[str, ExampleInputConf] = field(default_factory=dict)
    # null: the backend's default QAT mapping. Else {global, object_type, module_name,
    # module_name_regex, module_name_object_type_order}; each qconfig a preset name, null or a mapping.
    qconfig_mapping: Optional[Any] = None
    qconfig_presets: Dict[str, Any] = field(default_factory=dict)
    prepare: PrepareConf = field(default_factory=PrepareConf)
    convert: ConvertConf = field(default_factory=ConvertConf)
    equalization: Optional[Any] = None
    backend_config: Optional[str] = None


@dataclass
class TrainerConf:
    """Arguments passed to ``lightning.pytorch.Trainer`` (a typed subset; typos fail early)."""

    max_epochs: int = 8
    max_steps: int = -1
    accelerator: str = "cpu"
    devices: Any = 1
    num_nodes: int = 1
    strategy: str = "auto"
    precision: Any = "32-true"
    log_every_n_steps: int = 10
    limit_train_batches: Optional[Any] = None
    limit_val_batches: Optional[Any] = None
    limit_test_batches: Optional[Any] = None
    val_check_interval: Optional[Any] = None
    check_val_every_n_epoch: Optional[int] = 1
    num_sanity_val_steps: int = 2
    gradient_clip_val: Optional[float] = None
    accumulate_grad_batches: int = 1
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    deterministic: Optional[Any] = None
    benchmark: Optional[bool] = None


@dataclass
class CheckpointConf:
    """``ModelCheckpoint`` settings; checkpoints land in ``<run dir>/checkpoints``."""

    every_n_epochs: Optional[int] = 1
    every_n_train_steps: Optional[int] = None
    save_last: bool = True
    save_top_k: int = 1


@dataclass
class ReportConf:
    """The float / fake-quant / int8 comparison written after fit."""

    enabled: bool = True
    latency_batch_size: int = 32
    latency_repeats: int = 30
    latency_threads: Optional[int] = None


@dataclass
class TrainConfig:
    """The whole `qlightning train` configuration."""

    schema_version: int = SCHEMA_VERSION
    seed: int = 0
    ckpt_path: Optional[str] = None
    data: Dict[str, Any] = field(default_factory=dict)
    model: Dict[str, Any] = field(default_factory=dict)
    quant: QuantConf = field(default_factory=QuantConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    report: ReportConf = field(default_factory=ReportConf)
    export: ExportConf = field(default_factory=ExportConf)
    parity: ParityConf = field(default_factory=ParityConf)
    # Extra module prefixes whose classes `_target_` may name. Set on the command line or in
    # QLIGHTNING_TRUSTED_MODULES, never by a recipe.
    trusted_modules: List[str] = field(default_factory=list)
