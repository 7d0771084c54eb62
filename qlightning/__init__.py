"""qlightning: quantization-aware training as a drop-in PyTorch Lightning callback."""

from qlightning.callbacks import QuantizationAwareTraining
from qlightning.checkpoint import restore
from qlightning.engines import Inputs, QuantSpec, get_engine
from qlightning.errors import ConfigError, EngineUnavailableError, QLightningError, TraceError
from qlightning.schedule import Milestone, Phase, Schedule

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "EngineUnavailableError",
    "Inputs",
    "Milestone",
    "Phase",
    "QLightningError",
    "QuantSpec",
    "QuantizationAwareTraining",
    "Schedule",
    "TraceError",
    "get_engine",
    "restore",
    "__version__",
]
