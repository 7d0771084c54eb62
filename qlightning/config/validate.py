"""Every check of a composed config that can run without training, reported together."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from qlightning.core.inputs import resolve_targets
from qlightning.core.schedule import Schedule, beyond_trainer_limits
from qlightning.config.build import build_callback, check_targets, config_keys, instantiate_checked
from qlightning.config.checkpoint_check import check_checkpoint
from qlightning.config.dry_run import dry_run_problems, first_batch
from qlightning.config.export_schema import check_export_config
from qlightning.config.trainer_check import check_trainer
from qlightning.engines import engine_class
from qlightning.engines.fx.qconfig_builder import check_against_model
from qlightning.errors import ConfigError

#: the config keys of the sections :func:`check_against_model` names
QUANT_KEYS = {"qconfig_mapping": "quant.qconfig_mapping", "prepare": "quant.prepare"}


def describe(exc: BaseException) -> str:
    """``full.key: message`` from an OmegaConf / Hydra error, without the object dump.

    Args:
        exc: the error OmegaConf or Hydra raised.
    """
    cause = exc.__cause__ or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    full_key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), "")
    message = next((line for line in lines if not line.startswith(("full_key:", "reference_type", "object_type"))), str(cause))
    return f"{full_key}: {message}" if full_key else message


def interpolation_errors(node: Any, prefix: str = "") -> list[str]:
    """Every interpolation or resolver that fails (missing key, unknown resolver, bad argument), with its key path.

    Args:
        node: a config tree.
        prefix: the key path of ``node`` in the whole config.
    """
    errors: list[str] = []
    if isinstance(node, DictConfig):
        items = [(k, f"{prefix}.{k}" if prefix else str(k)) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(i, f"{prefix}[{i}]") for i in range(len(node))]
    else:
        return errors
    for key, path in items:
        try:
            value = node[key]
        except Exception as exc:  # InterpolationKeyError, UnsupportedInterpolationType, resolver errors
            message = describe(exc)
            errors.append(f"{path}: cannot resolve {_raw(node, key)!r}: {message.split(': ', 1)[-1] if message.startswith(path) else message}")
            continue
        errors.extend(interpolation_errors(value, path))
    return errors


def _raw(node: Any, key: Any) -> Any:
    try:
        return node._get_node(key)._value()
    except Exception:
        return "?"


def module_list_errors(cfg: Any) -> list[str]:
    """``quant.modules`` must be a flat list of names (a nested list used to be dropped silently).

    Args:
        cfg: the composed run config.
    """
    try:
        quant = cfg.get("quant") if isinstance(cfg, DictConfig) else None
        modules = quant.get("modules") if isinstance(quant, DictConfig) else None
    except Exception:  # an interpolation that does not resolve: reported by interpolation_errors
        return []
    if modules is None:
        return []
    if not isinstance(modules, ListConfig):
        return [f"quant.modules={OmegaConf.to_container(modules) if isinstance(modules, DictConfig) else modules!r}: "
                "give a list of submodule names or glob patterns, e.g. [net]"]
    errors = []
    for i in range(len(modules)):
        item = modules._get_node(i)
        value = OmegaConf.to_container(item, resolve=False) if isinstance(item, (DictConfig, ListConfig)) else item._value()
        if not isinstance(value, str) or not value:
            errors.append(f"quant.modules[{i}]={value!r}: each entry must be one submodule name or glob pattern "
                          "(nested lists are not flattened)")
    return errors


def static_problems(cfg: DictConfig) -> list[str]:
    """Checks that need neither the model nor the callback: targets, Trainer values, interpolations, module list.

    They run on a typed or an untyped config, so they are reported together with schema errors.

    Args:
        cfg: the composed run config.
    """
    problems = check_targets(cfg) + interpolation_errors(cfg) + module_list_errors(cfg)
    trainer = cfg.get("trainer")
    if isinstance(trainer, DictConfig):
        try:
            plain = OmegaConf.to_container(trainer, resolve=True, enum_to_str=True)
        except Exception:
            plain = None  # reported by interpolation_errors
        if plain is not None:
            problems += check_trainer(plain)
    return problems


def export_format_problems(cfg: DictConfig, callback: Any) -> list[str]:
    """Formats of ``export.formats`` the engine cannot build for this quantization, known before training.

    Args:
        cfg: the composed run config (its ``export.formats``).
        callback: the quantization callback built from it.
    """
    try:
        limits = callback.export_limits()
    except Exception:  # an engine that cannot load here is reported when the run needs it
        return []
    formats = [str(getattr(f, "value", f)) for f in (cfg.get("export") or {}).get("formats") or []]
    keep = [f for f in formats if f not in limits]
    return [
        f"export.formats: {fmt!r} cannot be built for this model: {limits[fmt]}; leave it out, "
        f"e.g. export.formats=[{','.join(keep) or 'torchscript'}]"
        for fmt in formats if fmt in limits
    ]


def schedule_limit_problems(cfg: DictConfig, callback: Any) -> list[str]:
    """Milestones past ``trainer.max_epochs`` / ``trainer.max_steps``: reported with the other configuration errors,
    before a Trainer exists (the callback finds them too, but only once the fit has started and printed its summary).

    Args:
        cfg: the composed run config (its ``trainer`` limits).
        callback: the quantization callback built from it (a derived schedule has no milestones to check).
    """
    schedule = getattr(callback, "schedule", None)
    if not isinstance(schedule, Schedule) or getattr(callback, "auto_schedule", None) is not None:
        return []  # a derived schedule holds a placeholder until the run's length is known

    def limit(key: str) -> Optional[int]:
        try:
            value = OmegaConf.select(cfg, f"trainer.{key}")
        except Exception:  # an interpolation error: reported by interpolation_errors
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return [config_keys(p) for p in beyond_trainer_limits(schedule, limit("max_epochs"), limit("max_steps"), "quant.schedule.")]


def runs_dry(cfg: DictConfig, dry_run: Optional[bool]) -> bool:
    """Whether :func:`validate_config` dry-runs: ``dry_run``, or for ``None`` where it costs seconds (fx).

    Args:
        cfg: the composed run config (its ``quant.engine``).
        dry_run: ``True`` / ``False`` as asked, ``None`` for the engine's default.
    """
    engine = engine_class(str(getattr(cfg.quant.get("engine"), "value", cfg.quant.get("engine"))))
    return bool(dry_run) or (dry_run is None and engine is not None and engine.dry_run_by_default)


def validate_config(cfg: DictConfig, dry_run: Optional[bool] = True) -> tuple[list[str], Any, Any]:
    """Returns ``(problems, callback or None, model or None)``.

    Checks: the ``_target_``s (by identity, before anything is built), Trainer values,
    interpolations, the callback's arguments (backend, engine, schedule, qconfigs, custom
    configs), then — with the model built, no data loaded — that every submodule name, regex and
    class the config mentions exists in the model, and that ``ckpt_path`` is a plain-data
    checkpoint of this very model. A remote ``ckpt_path`` allowed with ``allow_remote_ckpt=true``
    is downloaded and ``cfg.ckpt_path`` replaced by the local copy. When everything else passed, a dry
    prepare -> forward -> convert -> int8 forward of a copy of the model with the configured engine
    (:mod:`qlightning.config.dry_run`) reports what torch.ao / torchao would refuse.

    Args:
        cfg: the composed config.
        dry_run: ``True`` runs the dry run, ``False`` skips it, ``None`` runs it where it costs
            seconds (the fx engine; PT2E's ``convert_pt2e`` alone takes tens of seconds).
    """
    static = static_problems(cfg)
    problems = static + check_export_config(cfg)
    callback: Optional[Any] = None
    model: Optional[Any] = None
    if not any(p.startswith(("quant.modules", "quant:")) for p in static) and not any(
            "cannot resolve" in p for p in static):
        try:
            callback = build_callback(cfg)
        except ConfigError as exc:
            problems.extend(exc.problems)
        if callback is not None:
            problems.extend(export_format_problems(cfg, callback))
            problems.extend(schedule_limit_problems(cfg, callback))
    if not static:  # nothing is instantiated unless every _target_ and value passed
        try:
            model = instantiate_checked(cfg.model, "model")
        except ConfigError as exc:
            problems.extend(exc.problems)
        import lightning.pytorch as pl

        if model is not None and not isinstance(model, pl.LightningModule):
            problems.append(f"model._target_={cfg.model.get('_target_')!r}: built a {type(model).__name__}, not a LightningModule")
            model = None
    if model is not None:
        try:
            targets = resolve_targets(model, list(cfg.quant.modules), key="quant.modules")
            problems.extend(check_against_model({t: model.get_submodule(t) for t in targets}, cfg.quant, QUANT_KEYS))
        except ConfigError as exc:
            problems.extend(exc.problems)
    if model is not None and callback is not None and not problems and runs_dry(cfg, dry_run):
        problems.extend(dry_run_problems(cfg, callback, model, first_batch(cfg)))
    if cfg.get("ckpt_path") is not None and not problems:
        problems.extend(check_checkpoint(cfg, model, lambda: build_callback(cfg)))
    elif cfg.get("ckpt_path") is not None:
        problems.extend(check_checkpoint(cfg, None, lambda: build_callback(cfg)))
    return problems, callback, model
