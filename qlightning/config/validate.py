"""Every check of a composed config that can run without training, reported together."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig

from qlightning.core.inputs import resolve_targets
from qlightning.config.export_schema import check_export_config
from qlightning.config.build import build_callback, check_targets, instantiate_checked
from qlightning.config.qconfig import check_against_model
from qlightning.errors import ConfigError


def validate_config(cfg: DictConfig) -> tuple[list[str], Any, Any]:
    """Returns ``(problems, callback or None, model or None)``.

    Checks: allowlisted ``_target_``s, the callback's arguments (backend, engine, schedule,
    qconfigs, custom configs), then — with the model built, no data loaded — that every
    submodule name, regex and class the config mentions exists in the model.
    """
    problems = check_targets(cfg) + check_export_config(cfg)
    callback: Optional[Any] = None
    model: Optional[Any] = None
    try:
        callback = build_callback(cfg)
    except ConfigError as exc:
        problems.extend(exc.problems)
    if not any(p.startswith(("model", "data:")) for p in problems):
        try:
            model = instantiate_checked(cfg.model, "model")
        except ConfigError as exc:
            problems.extend(exc.problems)
    if model is not None:
        try:
            targets = resolve_targets(model, list(cfg.quant.modules), key="quant.modules")
            problems.extend(check_against_model({t: model.get_submodule(t) for t in targets}, cfg.quant))
        except ConfigError as exc:
            problems.extend(exc.problems)
    return problems, callback, model
