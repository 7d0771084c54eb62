"""Trainer keys checked against Lightning's own accepted values, before a ``Trainer`` is built.

Lightning raises on a bad ``precision``, ``accelerator`` or ``strategy`` only when the Trainer is
constructed (a traceback in the middle of ``qlightning train``), and does not check
``limit_*`` / ``val_check_interval`` ranges until the loop runs. The choices come from Lightning
itself: ``_PRECISION_INPUT`` and the accelerator and strategy registries.
"""

from __future__ import annotations

import typing
from typing import Any, Iterable, Mapping

from qlightning.engines.names import close


def precision_choices() -> list[Any]:
    """Every ``precision`` value Lightning's connector accepts (ints and strings)."""
    from lightning.fabric.connector import _PRECISION_INPUT

    out: list[Any] = []
    for literal in typing.get_args(_PRECISION_INPUT):
        out.extend(typing.get_args(literal) or [literal])
    return out


def accelerator_choices() -> list[str]:
    """The accelerator names Lightning's registry knows, plus ``auto`` and ``gpu``."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    return sorted(AcceleratorRegistry.available_accelerators()) + ["auto", "gpu"]


def strategy_choices() -> list[str]:
    """``auto`` and the strategy names Lightning's registry knows."""
    from lightning.pytorch.strategies import StrategyRegistry

    return ["auto"] + sorted(StrategyRegistry.available_strategies())


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _choice(key: str, value: Any, choices: Iterable[Any], errors: list[str]) -> None:
    choices = list(choices)
    if value not in choices:
        errors.append(f"{key}={value!r}: not a value Lightning accepts{close(str(value), [str(c) for c in choices])}; "
                      f"valid: {choices}")


def check_trainer(trainer: Mapping[str, Any], prefix: str = "trainer") -> list[str]:
    """Every bad Trainer value of a plain ``trainer`` section, each with the key and the valid choices.

    Args:
        trainer: the plain ``trainer`` section.
        prefix: its key path, for messages.
    """
    errors: list[str] = []
    if not isinstance(trainer, Mapping):
        return [f"{prefix}: expected a mapping of Trainer arguments, got {trainer!r}"]
    get = trainer.get
    if "precision" in trainer and get("precision") is not None:
        _choice(f"{prefix}.precision", get("precision"), precision_choices(), errors)
    if "accelerator" in trainer and get("accelerator") is not None:
        _choice(f"{prefix}.accelerator", get("accelerator"), accelerator_choices(), errors)
    if "strategy" in trainer and get("strategy") is not None:
        _choice(f"{prefix}.strategy", get("strategy"), strategy_choices(), errors)

    def at_least(key: str, low: int, allow_none: bool = False) -> None:
        if key not in trainer or (allow_none and get(key) is None):
            return
        if not _is_int(get(key)) or get(key) < low:
            errors.append(f"{prefix}.{key}={get(key)!r}: must be an integer >= {low}" + (" or null" if allow_none else ""))

    at_least("max_epochs", -1)
    at_least("max_steps", -1)
    at_least("num_nodes", 1)
    at_least("log_every_n_steps", 1)
    at_least("accumulate_grad_batches", 1)
    at_least("num_sanity_val_steps", -1)
    at_least("check_val_every_n_epoch", 1, allow_none=True)
    for key in ("limit_train_batches", "limit_val_batches", "limit_test_batches"):
        value = get(key)
        if value is None:
            continue
        ok = (_is_int(value) and value >= 0) or (isinstance(value, float) and 0.0 <= value <= 1.0)
        if not ok:
            errors.append(f"{prefix}.{key}={value!r}: give a batch count (integer >= 0) or a fraction in [0.0, 1.0], or null")
    value = get("val_check_interval")
    if value is not None:
        ok = (_is_int(value) and value >= 1) or (isinstance(value, float) and 0.0 < value <= 1.0)
        if not ok:
            errors.append(f"{prefix}.val_check_interval={value!r}: give a batch count (integer >= 1) or a fraction in (0.0, 1.0], or null")
    value = get("gradient_clip_val")
    if value is not None and (not _is_num(value) or value < 0):
        errors.append(f"{prefix}.gradient_clip_val={value!r}: must be a number >= 0 or null")
    devices = get("devices")
    if "devices" in trainer:
        ok = (_is_int(devices) and devices >= -1 and devices != 0) or devices == "auto" or (
            isinstance(devices, str) and devices.replace(",", "").replace("-", "").strip().isdigit()) or (
            isinstance(devices, list) and devices and all(_is_int(d) and d >= 0 for d in devices))
        if not ok:
            errors.append(f"{prefix}.devices={devices!r}: give a count (>= 1, -1 for all), 'auto', or a list of device indices")
    for key in ("enable_progress_bar", "enable_model_summary"):
        if key in trainer and not isinstance(get(key), bool):
            errors.append(f"{prefix}.{key}={get(key)!r}: must be true or false")
    if get("deterministic") not in (None, True, False, "warn"):
        errors.append(f"{prefix}.deterministic={get('deterministic')!r}: valid: [null, true, false, 'warn']")
    return errors
