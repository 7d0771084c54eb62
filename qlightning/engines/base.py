"""The one interface every quantization engine implements.

The callback speaks only this interface: prepare a float submodule, set the phase of the
schedule, switch observers off for evaluation, convert to a lowered int8 module. Everything that
knows torch.ao or torchao internals lives behind it, in one module per engine.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator, Optional

import torch
from torch import nn

from qlightning.core.inputs import Inputs
from qlightning.core.schedule import Phase

BACKENDS = ("x86", "fbgemm", "qnnpack", "onednn")


@dataclass
class QuantSpec:
    """Engine-neutral description of how to quantize one submodule.

    Attributes:
        backend: the int8 kernel library the model is lowered for; one of :data:`BACKENDS`.
        qconfig_mapping: ``None`` for the backend's default QAT mapping, else a native object of
            the engine (``QConfigMapping`` for FX) built by :mod:`qlightning.config`.
        prepare_custom_config: native prepare-time custom config (FX ``PrepareCustomConfig``) or ``None``.
        convert_custom_config: native convert-time custom config (FX ``ConvertCustomConfig``) or ``None``.
        backend_config: native backend config, ``None`` for the backend's own.
        is_qat: prepare for training (fake-quant) rather than for calibration (observers).
        options: engine-specific extras that the config layer passes through untouched.
    """

    backend: str = "x86"
    qconfig_mapping: Any = None
    prepare_custom_config: Any = None
    convert_custom_config: Any = None
    backend_config: Any = None
    is_qat: bool = True
    options: dict[str, Any] = field(default_factory=dict)


class QuantEngine(ABC):
    """prepare / set_phase / set_observers / convert: the symmetric pairs of a quantization engine."""

    name: ClassVar[str]

    @abstractmethod
    def prepare(self, module: nn.Module, inputs: Inputs, spec: QuantSpec) -> nn.Module:
        """Fuse and instrument a float module (train mode for QAT); return the module to put in its place."""

    @abstractmethod
    def set_phase(self, module: nn.Module, phase: Phase) -> None:
        """Switch fake-quant, observers and BatchNorm statistics of a prepared module to ``phase``."""

    @abstractmethod
    def set_observers(self, module: nn.Module, enabled: bool) -> None:
        """Enable or disable observer updates only (used around validation, test and predict)."""

    @abstractmethod
    def convert(self, module: nn.Module, spec: QuantSpec) -> nn.Module:
        """Turn a prepared module into the quantized module lowered for ``spec.backend``."""

    @abstractmethod
    def quant_state(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Every buffer that belongs to an observer or fake-quant (statistics, scales, zero points, flags)."""

    def resolve_spec(self, spec: QuantSpec, errors: list[str]) -> QuantSpec:
        """Turn plain-data parts of ``spec`` (dicts from a config) into the engine's native objects.

        Problems are appended to ``errors``; the default accepts native objects only.
        """
        return spec

    def check_spec_against_model(self, spec: QuantSpec, modules: dict[str, nn.Module]) -> list[str]:
        """Config entries that name nothing in the modules about to be prepared."""
        return []

    def is_prepared(self, module: nn.Module) -> bool:
        return any(True for _ in self.quant_state(module))

    def describe_qparams(self, module: nn.Module) -> dict[str, dict[str, Any]]:
        """Scale / zero point summaries per observer, for logging and reports."""
        return {}

    def reference_module(self, prepared: nn.Module, int8: nn.Module, spec: Optional[QuantSpec]) -> nn.Module:
        """A float graph of quantize/dequantize ops that computes what ``int8`` computes.

        The exporters (ONNX, ``.pt2``) and the lowering candidates start from it. The default is a
        copy of the converted module, right for engines whose int8 model already is such a graph.

        Args:
            prepared: the prepared (fake-quant) module ``int8`` was converted from; never modified.
            int8: the engine's converted module.
            spec: the spec it was converted with (``None``: the engine's defaults).
        """
        return copy.deepcopy(int8).eval()


def quantized_engine(backend: str) -> "torch.backends.quantized._QEngineProp":
    """Select ``backend`` as torch's quantized kernel library (process-wide), checking it exists."""
    supported = torch.backends.quantized.supported_engines
    if backend not in supported:
        raise RuntimeError(f"quantized backend {backend!r} is not available in this torch build; available: {supported}")
    torch.backends.quantized.engine = backend
    return torch.backends.quantized.engine
