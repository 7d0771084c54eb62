"""A dry prepare -> forward -> convert -> int8 forward of a config's model, as config problems.

The schema and the semantic checks read values; only the engine (torch.ao / torchao) knows whether it
can prepare and convert *this* model with them. A qconfig mapping that gives ``torch.nn.Conv2d`` 4-bit
weights but leaves the BatchNorm2d fused into it on the default is valid data, and torch.ao raises a
``LookupError`` twenty frames deep at fit start. :func:`dry_run_problems` runs the engine once on the
model's example input (seconds on the shipped models) and turns what it raises into messages that name
the config key and the fix, for ``qlightning recipes validate`` and for ``qlightning train`` before its
first step.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from qlightning.errors import ConfigError, DryRunError, TraceError

_FUSION = re.compile(r"same qconfigs for all module types in <class '([\w.]+)'> offending type: <class '([\w.]+)'>")


def _public(path: str) -> str:
    """``torch.nn.modules.batchnorm.BatchNorm2d`` -> ``torch.nn.BatchNorm2d`` (the name a config uses)."""
    parts = path.split(".")
    if path.startswith("torch.nn.modules."):
        return f"torch.nn.{parts[-1]}"
    if path.startswith("torch.ao.nn.intrinsic.modules."):
        return f"torch.ao.nn.intrinsic.{parts[-1]}"
    return path


def _set(quant: Any, key: str) -> bool:
    try:
        value = OmegaConf.select(quant, key) if isinstance(quant, DictConfig) else None
    except Exception:
        return False
    if isinstance(value, DictConfig):
        return any(v not in (None, [], {}) for v in OmegaConf.to_container(value).values())
    return value not in (None, [], {})


def explain(exc: DryRunError, quant: Any) -> str:
    """One message for a failed dry run: the config key, what the engine said, and the fix.

    Args:
        exc: the dry run's failure (its stage, target and cause).
        quant: the config's ``quant`` section; the key blamed is the first of the stage's keys that is set.
    """
    cause = exc.cause
    said = " ".join(str(cause).split())[:400]
    fused = _FUSION.search(str(cause))
    if exc.stage == "prepare" and isinstance(cause, LookupError) and fused:
        key = "quant.qconfig_mapping.object_type" if _set(quant, "qconfig_mapping.object_type") else "quant.qconfig_mapping"
        pattern, offending = _public(fused.group(1)), _public(fused.group(2))
        return (f"{key}: {exc.target} cannot be prepared: torch.ao fuses {pattern} into one module, and {offending} "
                f"in it gets another qconfig than the layer it is fused with. Give every type of the pattern the same "
                f"qconfig (add an object_type entry for {offending}, and for the other parts of {pattern}), or set "
                f"that qconfig as `global` / for the module by `module_name`")
    if exc.stage in ("prepare", "forward"):
        key = next((f"quant.{k}" for k in ("qconfig_mapping", "prepare", "backend_config") if _set(quant, k)), "quant.modules")
    elif exc.stage == "convert":
        key = next((f"quant.{k}" for k in ("convert", "qconfig_mapping", "backend_config") if _set(quant, k)), "quant.backend")
    else:  # int8 forward: the lowered kernels
        key = next((f"quant.{k}" for k in ("qconfig_mapping", "convert") if _set(quant, k)), "quant.backend")
    return (f"{key}: a dry run of {exc.target} failed at {exc.stage} ({type(cause).__name__}: {said}); this run "
            f"would fail the same way at {'fit start' if exc.stage in ('prepare', 'forward') else 'fit end'}. "
            f"Change {key}, or quantize other submodules (quant.modules)")


def dry_run_problems(cfg: DictConfig, callback: Any, model: Any, batch_source: Optional[Callable[[], Any]] = None) -> list[str]:
    """Prepare a copy of ``model``'s targets with the configured engine, run them, convert, run int8.

    Args:
        cfg: the composed config (for the key paths of messages).
        callback: the quantization callback :func:`~qlightning.config.build.build_callback` made.
        model: the LightningModule built from ``cfg.model``; not modified.
        batch_source: one training batch, for models without ``example_input_array`` or
            ``quant.example_inputs`` (called only then).

    Returns:
        Problems (empty: the engine prepared, converted and ran every target).
    """
    quant = cfg.get("quant")
    # dynamic / weight-only PTQ falls back to eager quantize_dynamic where FX cannot prepare a module
    eager_fallback = getattr(callback, "mode", "static") != "static" and getattr(callback, "dynamic_fallback", None) == "eager"
    try:
        callback.engine  # resolved lazily; an engine missing here is the callback's own, clear error
        callback.session.dry_run(model, batch_source)
    except DryRunError as exc:
        return [] if eager_fallback and exc.stage == "prepare" else [explain(exc, quant)]
    except ConfigError as exc:
        return exc.problems
    except TraceError as exc:
        return [] if eager_fallback else [f"quant.modules: {exc}"]
    return []


def first_batch(cfg: DictConfig) -> Callable[[], Any]:
    """A callable returning one training batch of ``cfg.data`` (the data module is built only if called).

    Args:
        cfg: the composed config whose ``data`` node builds the data module (``prepare_data``,
            ``setup("fit")``, first batch of the train loader).
    """

    def batch() -> Any:
        from qlightning.config.build import instantiate_checked

        datamodule = instantiate_checked(cfg.data, "data")
        datamodule.prepare_data()
        datamodule.setup("fit")
        return next(iter(datamodule.train_dataloader()))

    return batch
