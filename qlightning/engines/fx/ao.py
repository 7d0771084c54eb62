"""The torch.ao pieces the FX engine uses, imported in one place, and the noise they make silenced."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from qlightning.core.quiet import quiet
from qlightning.errors import EngineUnavailableError

# Warnings torch.ao raises on every call of the deprecated API; we say it once, in the README.
_NOISY = (
    r".*torch\.ao\.quantization is deprecated.*",
    r".*reduce_range will be deprecated.*",
    r".*quantized tensor creation functions.*deprecated.*",
    r".*must run observer before calling calculate_qparams.*",
)


def quiet_torch_ao() -> Any:
    """Silence the deprecation warnings torch.ao raises on every call (said once, in the README)."""
    return quiet(messages=_NOISY)


def load_torch_ao() -> SimpleNamespace:
    """Import the torch.ao pieces the FX engine needs, or explain why they are missing."""
    try:
        with quiet_torch_ao():
            from torch.ao.nn.intrinsic import qat as nniqat
            from torch.ao.quantization import (
                FakeQuantizeBase,
                ObserverBase,
                QConfigMapping,
                get_default_qat_qconfig,
                get_default_qat_qconfig_mapping,
                get_default_qconfig_mapping,
            )
            from torch.ao.quantization.backend_config import (
                get_fbgemm_backend_config,
                get_onednn_backend_config,
                get_qnnpack_backend_config,
            )
            from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
            from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx, prepare_qat_fx
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise EngineUnavailableError(
            f"engine='fx' needs torch.ao FX graph mode quantization (torch.ao.quantization.quantize_fx), "
            f"which torch {torch.__version__} does not provide ({exc}). FX graph mode is deprecated upstream; "
            "use engine='pt2e' (torchao), or install a torch that still ships it (2.13 or 2.14)."
        ) from exc
    return SimpleNamespace(**{k: v for k, v in locals().items() if k != "exc"})


def backend_config_for(backend: str) -> Any:
    """torch.ao's ``BackendConfig`` of ``backend`` (x86, fbgemm, qnnpack, onednn).

    Args:
        backend: ``"x86"``, ``"fbgemm"``, ``"qnnpack"`` or ``"onednn"`` (another name raises ``KeyError``).
    """
    ao = load_torch_ao()
    return {
        "x86": ao.get_x86_backend_config,
        "fbgemm": ao.get_fbgemm_backend_config,
        "qnnpack": ao.get_qnnpack_backend_config,
        "onednn": ao.get_onednn_backend_config,
    }[backend]()


#: The average pools and means torch.ao's backend configs quantize with their input's observer
#: (``OUTPUT_SHARE_OBSERVER_WITH_INPUT``); :func:`with_pool_observers` gives them one of their own.
AVERAGE_POOL_MODULES = (torch.nn.AvgPool1d, torch.nn.AvgPool2d, torch.nn.AvgPool3d, torch.nn.AdaptiveAvgPool1d,
                        torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveAvgPool3d)
AVERAGE_POOL_FUNCTIONS = (torch.nn.functional.avg_pool1d, torch.nn.functional.avg_pool2d,
                          torch.nn.functional.avg_pool3d, torch.nn.functional.adaptive_avg_pool1d,
                          torch.nn.functional.adaptive_avg_pool2d, torch.nn.functional.adaptive_avg_pool3d, torch.mean)


def with_pool_observers(config: Any) -> Any:
    """``config`` (a ``BackendConfig``, changed in place and returned) with every average pool and mean observing
    its own output (``OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT``) instead of sharing its input's observer.

    Why (notes/perf.md section 15): on the input's grid a mean of ``HW`` codes is ``k / HW`` of a step, an exact
    half-step tie whenever ``HW`` is even and the sum falls on one (25 % of the values of a 2x2 map), and which
    way a tie rounds is decided by each runtime's float arithmetic: inductor's int8 efficientnet_b0 departed
    from its fake-quant model by 20.6 dB that way. A grid of its own has no such ties and a finer step for the
    narrower range of a mean.

    Args:
        config: the backend config to change.
    """
    with quiet_torch_ao():
        from torch.ao.quantization.backend_config import BackendPatternConfig, ObservationType

    for pattern_config in list(config.configs):
        pattern = pattern_config.pattern
        if pattern not in (*AVERAGE_POOL_MODULES, *AVERAGE_POOL_FUNCTIONS, "mean"):  # "mean": the Tensor method
            continue
        if pattern_config.observation_type != ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT:
            continue
        own = BackendPatternConfig(pattern_config.pattern)
        own.set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
        own.set_dtype_configs(pattern_config.dtype_configs)
        config.set_backend_pattern_config(own)
    return config


def default_weight_observer() -> Any:
    """torch.ao's ``default_weight_observer`` (8-bit per-tensor symmetric): where range imbalance hurts."""
    with quiet_torch_ao():
        from torch.ao.quantization import default_weight_observer as observer
    return observer


def default_ptq_qconfig_mapping(backend: str) -> Any:
    """torch.ao's default PTQ ``QConfigMapping`` of ``backend``.

    Args:
        backend: the backend name, as ``get_default_qconfig_mapping`` takes it.
    """
    with quiet_torch_ao():
        return load_torch_ao().get_default_qconfig_mapping(backend)


def equalization_qconfig_mapping(layers: Any) -> Any:
    """A ``QConfigMapping`` giving ``default_equalization_qconfig`` to each named layer (FX ``_equalization_config``).

    Args:
        layers: the module names to equalize.
    """
    with quiet_torch_ao():
        from torch.ao.quantization import QConfigMapping
        from torch.ao.quantization.fx._equalize import default_equalization_qconfig

    mapping = QConfigMapping()
    for name in layers:
        mapping.set_module_name(name, default_equalization_qconfig)
    return mapping


def fuse(module: Any) -> Any:
    """``fuse_fx`` of ``module`` (eval): Conv-BN-ReLU -> ConvReLU with BN folded, as FX PTQ fuses it.

    Args:
        module: the float module, in eval mode.
    """
    with quiet_torch_ao():
        from torch.ao.quantization.quantize_fx import fuse_fx

        return fuse_fx(module)


def backend_config_callables() -> list[Any]:
    """Every module class and function the backend configs of torch.ao name in a pattern (what a
    qconfig mapping's ``object_type`` may name), for the config allowlist."""
    with quiet_torch_ao():
        import torch.ao.quantization.backend_config.utils  # noqa: F401  (the getters below need it imported)
        from torch.ao.quantization import backend_config as bc

    def flatten(p: Any) -> Any:
        if isinstance(p, tuple):
            for item in p:
                yield from flatten(item)
        elif not isinstance(p, str):
            yield p

    getters = [bc.get_native_backend_config, bc.get_fbgemm_backend_config, bc.get_qnnpack_backend_config,
               bc.get_onednn_backend_config, bc.get_executorch_backend_config]
    found: dict[int, Any] = {}
    for getter in getters:
        for config in getter().configs:
            pattern = config.pattern if config.pattern is not None else config._pattern_complex_format
            for obj in flatten(pattern):
                if obj is not None and callable(obj):
                    found[id(obj)] = obj
    return list(found.values())


def observer_base_classes() -> tuple[type, ...]:
    """torch.ao's observer and fake-quant base classes."""
    with quiet_torch_ao():
        from torch.ao.quantization import FakeQuantizeBase
        from torch.ao.quantization.observer import ObserverBase
    return (ObserverBase, FakeQuantizeBase)
