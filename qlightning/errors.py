"""Error types of qlightning: each names the config key or argument, the bad value and the choices."""

from __future__ import annotations

from typing import Iterable, Union


class QLightningError(Exception):
    """Base class of every error qlightning raises on purpose."""


class ConfigError(QLightningError, ValueError):
    """One or more invalid settings, all reported together.

    Args:
        problems: one message or several; each names the key, the bad value and the valid choices.
    """

    def __init__(self, problems: Union[str, Iterable[str]]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} configuration errors:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


class EngineUnavailableError(QLightningError, RuntimeError):
    """The chosen quantization engine cannot run with the installed torch / torchao."""


class TraceError(QLightningError, RuntimeError):
    """A submodule could not be traced or prepared; the message says which and suggests a route."""


class FidelityError(QLightningError, RuntimeError):
    """The int8 model that would ship departs from the fake-quant model that trained; the message says where."""


class IncompleteScheduleError(QLightningError, RuntimeError):
    """A fit ended before its QAT schedule quantized anything; converting would ship uninitialised scales."""


class ReferenceUnavailableError(QLightningError, RuntimeError):
    """No q/dq reference graph can express a converted module (e.g. a static custom module such as
    torch.ao's quantized LSTM): ONNX / ``.pt2`` cannot be built and the parity gate has no int8 reference."""


class DryRunError(QLightningError, RuntimeError):
    """A dry prepare -> forward -> convert -> int8 forward of a target failed (raised before training).

    Attributes:
        stage: ``"prepare"``, ``"forward"`` (the prepared module), ``"convert"`` or ``"int8 forward"``.
        target: the submodule name.
        cause: the engine's (torch.ao / torchao) exception.
    """

    def __init__(self, stage: str, target: str, cause: BaseException) -> None:
        self.stage, self.target, self.cause = stage, target, cause
        super().__init__(f"{target}: {stage} failed: {type(cause).__name__}: {cause}")
