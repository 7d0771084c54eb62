"""qlightning: quantization-aware training as a drop-in PyTorch Lightning callback."""

from qlightning.callbacks import PostTrainingQuantization, QuantizationAwareTraining
from qlightning.callbacks.checkpoint import (
    AtomicCheckpointIO,
    ModelCheckpointWithFinalLast,
    QATCheckpointMixin,
    ResumableDataLoader,
    restore,
)
from qlightning.engines import Inputs, QuantSpec, get_engine
from qlightning.errors import ConfigError, EngineUnavailableError, QLightningError, TraceError
from qlightning.core.schedule import Milestone, Phase, Schedule

__version__ = "0.1.0"

__all__ = [
    "AtomicCheckpointIO",
    "ConfigError",
    "EngineUnavailableError",
    "Inputs",
    "Milestone",
    "ModelCheckpointWithFinalLast",
    "Phase",
    "PostTrainingQuantization",
    "QATCheckpointMixin",
    "QLightningError",
    "QuantSpec",
    "QuantizationAwareTraining",
    "ResumableDataLoader",
    "Schedule",
    "TraceError",
    "get_engine",
    "restore",
    "__version__",
]
