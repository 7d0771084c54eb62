"""From a composed config to objects: checked first, everything reported at once."""

from __future__ import annotations

import re

from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from qlightning.callbacks import PostTrainingQuantization, QuantizationAwareTraining
from qlightning.config.allowlist import check_class_paths
from qlightning.engines import Inputs, check_engine_options
from qlightning.errors import ConfigError


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _milestone(node: Any) -> Any:
    if node is None:
        return None
    return {k: v for k, v in OmegaConf.to_container(node).items() if v is not None} or None


def _example_inputs(node: Any, errors: list[str]) -> dict[str, Inputs]:
    inputs = {}
    for name, spec in (OmegaConf.to_container(node) if node is not None else {}).items():
        key = f"quant.example_inputs.{name}"
        if not isinstance(spec, dict) or set(spec) - {"shape", "dtype"} or "shape" not in spec:
            errors.append(f"{key}={spec!r}: expected {{shape: [sizes], dtype: float32}}")
            continue
        dtype = getattr(torch, str(spec.get("dtype", "float32")), None)
        if not isinstance(dtype, torch.dtype):
            errors.append(f"{key}.dtype={spec.get('dtype')!r}: not a torch dtype (e.g. float32, int64)")
            continue
        shape_ok = isinstance(spec["shape"], list) and spec["shape"] and all(isinstance(d, int) and d >= 1 for d in spec["shape"])
        if not shape_ok:
            errors.append(f"{key}.shape={spec['shape']!r}: give positive sizes, e.g. [1, 1, 8, 8]")
            continue
        shape = list(spec["shape"])
        tensor = torch.zeros(shape, dtype=dtype) if not dtype.is_floating_point else torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
        inputs[str(name)] = Inputs((tensor,))
    return inputs


def callback_kwargs(quant: DictConfig, errors: list[str], trusted: Any = ()) -> dict[str, Any]:
    """Keyword arguments of :class:`QuantizationAwareTraining` from ``cfg.quant``.

    Args:
        quant: the ``quant`` section of the composed config.
        errors: list that problems with ``quant.example_inputs`` are appended to.
        trusted: module names the user trusts (passed as ``trusted_modules``).
    """
    return {
        "modules": list(quant.modules),
        "backend": _enum_value(quant.backend),
        "engine": _enum_value(quant.engine),
        **({"fake_quant_start": "auto", "observer_freeze": "auto", "bn_freeze": "auto"} if quant.schedule.get("auto") else {
            "fake_quant_start": _milestone(quant.schedule.fake_quant_start),
            "observer_freeze": _milestone(quant.schedule.observer_freeze),
            "bn_freeze": _milestone(quant.schedule.bn_freeze),
        }),
        "observe_stages": [_enum_value(s) for s in quant.observe_stages],
        "convert_on_fit_end": bool(quant.convert_on_fit_end),
        "example_inputs": _example_inputs(quant.example_inputs, errors),
        "qconfig_mapping": quant.qconfig_mapping,
        "qconfig_presets": quant.qconfig_presets,
        "prepare_custom_config": quant.prepare if _is_set(quant.prepare) else None,
        "convert_custom_config": quant.convert if _is_set(quant.convert) else None,
        "equalization": quant.equalization,
        "backend_config": quant.backend_config,
        "trusted_modules": list(trusted),
        "engine_options": OmegaConf.to_container(quant.engine_options) if quant.get("engine_options") else None,
        "lowering": _enum_value(quant.lowering),
        "lowering_candidates": list(quant.lowering_candidates) or None,
        "lowering_batch_size": int(quant.lowering_batch_size),
        "lowering_min_sqnr_db": float(quant.lowering_min_sqnr_db),
        "fidelity": {k: _enum_value(v) for k, v in OmegaConf.to_container(quant.fidelity).items()},
        "on_incomplete_schedule": _enum_value(quant.on_incomplete_schedule),
        "calibration_batches": int(quant.calibration_batches),
    }


def _is_set(node: Any) -> bool:
    """A custom-config section with at least one non-empty entry."""
    return any(bool(v) for v in OmegaConf.to_container(node).values())


PTQ_ONLY = ("mode", "calibrate_on", "num_calibration_batches", "equalization", "cross_layer_equalization")


# Callback argument -> config key: the callbacks and engines name their arguments; the config layer
# says which key of the config to change.
ARGUMENT_KEYS = {
    "prepare_custom_config": "quant.prepare",
    "convert_custom_config": "quant.convert",
    "equalization_config": "quant.equalization",
    "ptq_baseline": "quant.ptq.baseline",
    "num_calibration_batches": "quant.ptq.num_calibration_batches",
    "calibrate_on": "quant.ptq.calibrate_on",
    "cross_layer_equalization": "quant.ptq.cross_layer_equalization",
    "mode": "quant.ptq.mode",
    "fidelity": "quant.fidelity",
    "on_incomplete_schedule": "quant.on_incomplete_schedule",
    "calibration_batches": "quant.calibration_batches",
    "fake_quant_start": "quant.schedule.fake_quant_start",
    "observer_freeze": "quant.schedule.observer_freeze",
    "bn_freeze": "quant.schedule.bn_freeze",
}
_ARGUMENT = re.compile(
    r"(?<![\w.])(engine_options|engine|backend_config|backend|qconfig_mapping|prepare_custom_config|convert_custom_config"
    r"|equalization_config|equalization|modules|fake_quant_start|observer_freeze|bn_freeze|observe_stages|example_inputs"
    r"|lowering_candidates|lowering_batch_size|lowering_min_sqnr_db|lowering|ptq_baseline|num_calibration_batches"
    r"|calibrate_on|cross_layer_equalization|convert_on_fit_end|fidelity|on_incomplete_schedule|calibration_batches|schedule)(?=[=\[:]|\.\w)"
)


# the callback's advice, as the command line would give it
ADVICE = {
    "leave the schedule to the run (the default)": "set quant.schedule.auto=true (milestones from the run's length)",
}


def config_keys(message: str) -> str:
    """A callback or engine message with its argument names as config keys (``engine='fx'`` -> ``quant.engine=fx``)
    and its advice in command-line terms.

    Args:
        message: the message; one that already starts with ``quant.`` only has its advice rewritten.
    """
    for said, cli in ADVICE.items():
        message = message.replace(said, cli)
    if message.startswith("quant."):
        return message

    def key(match: "re.Match[str]") -> str:
        name = match.group(1)
        return ARGUMENT_KEYS.get(name, f"quant.{name}")

    text = re.sub(r"engine='(\w+)'", r"quant.engine=\1", message)
    text = re.sub(r"backend='(\w+)'", r"quant.backend=\1", text)
    return _ARGUMENT.sub(key, text)


def build_callback(cfg: DictConfig) -> Any:
    """The quantization callback of a config (QAT or PTQ); all problems in one :class:`ConfigError`.

    Args:
        cfg: the composed config; ``quant.method`` picks :class:`PostTrainingQuantization` (``ptq``) or
            :class:`QuantizationAwareTraining`, and ``trusted_modules`` is passed on.
    """
    errors: list[str] = []
    kwargs = callback_kwargs(cfg.quant, errors, cfg.get("trusted_modules", []))
    ptq = cfg.quant.ptq
    try:
        if _enum_value(cfg.quant.method) == "ptq":
            for key in ("fake_quant_start", "observer_freeze", "bn_freeze", "observe_stages", "convert_on_fit_end",
                        "lowering", "lowering_candidates", "lowering_batch_size", "lowering_min_sqnr_db",
                        "on_incomplete_schedule", "calibration_batches"):
                kwargs.pop(key, None)
            user_options = kwargs.pop("engine_options") or {}
            check_engine_options(kwargs["engine"], user_options, errors, "quant.engine_options")
            options = {**user_options, "qconfig_presets": kwargs.pop("qconfig_presets") or {}, "trusted": kwargs.pop("trusted_modules")}
            callback = PostTrainingQuantization(
                **kwargs, engine_options=options, mode=_enum_value(ptq.mode), calibrate_on=_enum_value(ptq.calibrate_on),
                num_calibration_batches=ptq.num_calibration_batches, cross_layer_equalization=ptq.cross_layer_equalization,
            )
        else:
            callback = QuantizationAwareTraining(**kwargs, ptq_baseline=ptq.num_calibration_batches if ptq.baseline else False)
    except ConfigError as exc:
        errors.extend(config_keys(p) for p in exc.problems)
        callback = None
    if errors:
        raise ConfigError(errors)
    return callback  # type: ignore[return-value]


def check_targets(cfg: DictConfig) -> list[str]:
    """Problems with what the config would instantiate: ``data`` and ``model`` need a ``_target_``, and
    every class path must be allowed (:func:`~qlightning.config.allowlist.check_class_paths`).

    Args:
        cfg: the composed config (its ``trusted_modules`` are trusted too).

    Returns:
        One message per problem; empty when all is well.
    """
    errors = []
    for group in ("data", "model"):
        node = cfg.get(group)
        if not node or "_target_" not in node:
            errors.append(f"{group}: needs a _target_ (the class to build), e.g. qlightning.examples.DigitsDataModule")
    errors += check_class_paths(cfg, cfg.get("trusted_modules", []))
    return errors


def instantiate_checked(node: DictConfig, key: str) -> Any:
    """Hydra ``instantiate`` of ``node`` (``_convert_="all"``); a failure becomes one :class:`ConfigError`.

    Args:
        node: the config node with a ``_target_``.
        key: the node's config key, for the message.
    """
    try:
        return instantiate(node, _convert_="all")
    except Exception as exc:
        cause = exc.__cause__ or exc
        raise ConfigError(f"{key}: could not build {node.get('_target_')!r}: {type(cause).__name__}: {cause}") from None
