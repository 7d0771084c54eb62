"""Quantization engines behind one interface; looked up by name, imported only when used."""

from __future__ import annotations

from qlightning.engines.base import BACKENDS, Inputs, QuantEngine, QuantSpec
from qlightning.errors import ConfigError

ENGINES = ("fx", "pt2e")


def get_engine(name: str) -> QuantEngine:
    """Return the engine called ``name`` (``fx`` or ``pt2e``).

    Importing an engine's module never fails at ``import qlightning`` time; an engine whose
    torch/torchao support is missing raises :class:`~qlightning.errors.EngineUnavailableError` here.
    """
    if name == "fx":
        from qlightning.engines.fx import FxEngine

        return FxEngine()
    if name == "pt2e":
        from qlightning.engines.pt2e import Pt2eEngine

        return Pt2eEngine()
    raise ConfigError(f"quant.engine={name!r}: unknown engine; valid choices: {list(ENGINES)}")


__all__ = ["BACKENDS", "ENGINES", "Inputs", "QuantEngine", "QuantSpec", "get_engine"]
