"""Plain data -> torch.ao objects: qconfigs, qconfig mappings, prepare/convert custom configs.

The same builders serve the Hydra config and the Python API (a dict or OmegaConf node passed to
the callback), so both routes give the same prepared graph. Every problem is appended to an
``errors`` list naming the config key, the bad value and the valid choices; nothing is raised
until the caller has collected everything.

Formats (YAML)::

    qconfig_mapping:
      global: default                       # preset name | null (do not quantize) | {activation:, weight:}
      object_type: [{type: torch.nn.Linear, qconfig: w4a8}]
      module_name: [{name: features.0, qconfig: null}]
      module_name_regex: [{regex: "features\\.3.*", qconfig: per_tensor_affine}]
      module_name_object_type_order: [{module_name: "", object_type: torch.nn.functional.linear, index: 0, qconfig: null}]

    a qconfig: {activation: OBS, weight: OBS}; OBS = {fake_quant: fused_moving_avg | fake_quantize | learnable | null,
      observer: moving_average_minmax | ..., dtype: quint8, qscheme: per_tensor_affine, quant_min:, quant_max:,
      reduce_range:, averaging_constant:, ch_axis:, eps:}
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.resources
import re
from typing import Any, Iterable, Mapping, Optional

import torch
from omegaconf import OmegaConf

from qlightning.engines.fx.weights import default_qat_qconfig, default_qat_qconfig_mapping
from qlightning.engines.names import close, plain, resolve_reference

OBSERVERS = {
    "minmax": "MinMaxObserver",
    "moving_average_minmax": "MovingAverageMinMaxObserver",
    "per_channel_minmax": "PerChannelMinMaxObserver",
    "moving_average_per_channel_minmax": "MovingAveragePerChannelMinMaxObserver",
    "histogram": "HistogramObserver",
    "placeholder": "PlaceholderObserver",
    "noop": "NoopObserver",
}
FAKE_QUANTS = {
    "fused_moving_avg": "torch.ao.quantization.fake_quantize.FusedMovingAvgObsFakeQuantize",
    "fake_quantize": "torch.ao.quantization.fake_quantize.FakeQuantize",
    "learnable": "torch.ao.quantization._learnable_fake_quantize._LearnableFakeQuantize",
}
DTYPES = {"quint8": torch.quint8, "qint8": torch.qint8, "qint32": torch.qint32, "quint4x2": torch.quint4x2,
          "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8, "int8": torch.int8}
QSCHEMES = {
    "per_tensor_affine": torch.per_tensor_affine,
    "per_tensor_symmetric": torch.per_tensor_symmetric,
    "per_channel_affine": torch.per_channel_affine,
    "per_channel_symmetric": torch.per_channel_symmetric,
    "per_channel_affine_float_qparams": torch.per_channel_affine_float_qparams,
}
OBS_KEYS = {"fake_quant", "observer", "dtype", "qscheme", "quant_min", "quant_max", "reduce_range",
            "averaging_constant", "ch_axis", "eps", "is_dynamic", "scale", "zero_point", "use_grad_scaling", "bins"}
# the weights of a qconfig mapping that gives only its activations
DEFAULT_WEIGHT = {"observer": "minmax", "dtype": "qint8", "qscheme": "per_tensor_symmetric"}
NATIVE_PRESETS = ("default", "float16_static", "float16_dynamic", "dynamic", "weight_only")
MAPPING_KEYS = ("global", "object_type", "module_name", "module_name_regex", "module_name_object_type_order")


def load_presets() -> dict[str, dict]:
    """The shipped qconfig presets in ``qlightning/config/qconfig_presets/*.yaml``, by file name.

    They are preset data, not a Hydra config group (a group would be listed by ``qlightning train --help``
    without being selectable): a config or Python names them in a plain-data ``qconfig_mapping``. Read as package data of :mod:`qlightning.config` (no code of it is imported).
    Parsed once per process (~60 ms of YAML, which every callback and engine spec paid); each call gets its own copy.
    """
    return copy.deepcopy(_parsed_presets())


@functools.lru_cache(maxsize=1)
def _parsed_presets() -> dict[str, dict]:
    presets = {}
    for item in importlib.resources.files("qlightning.config").joinpath("qconfig_presets").iterdir():
        if item.name.endswith(".yaml"):
            presets[item.name[:-5]] = plain(OmegaConf.create(item.read_text()))
    return presets


class QConfigBuilder:
    """Builds torch.ao objects from plain data for one backend and mode (QAT or PTQ).

    Every builder method appends its problems (naming the config key) to ``errors`` and returns ``None``
    for what it could not build.

    Args:
        backend: the quantized backend (``x86``, ``fbgemm``, ``qnnpack``, ``onednn``).
        is_qat: build fake-quants (QAT) rather than observers (PTQ).
        presets: extra qconfig presets by name, over the shipped ones (:func:`load_presets`).
        trusted: module names the user trusts for class paths (observers, object types, custom modules).
    """

    def __init__(self, backend: str, is_qat: bool, presets: Optional[Mapping[str, Any]] = None,
                 trusted: Iterable[str] = ()) -> None:
        self.backend = backend
        self.is_qat = is_qat
        self.presets = {**load_presets(), **plain(presets or {})}
        self.trusted = list(trusted)
        from torch.ao import quantization as tq

        self.tq = tq

    # ---------------------------------------------------------------- one observer / fake-quant
    def observer(self, spec: Any, key: str, errors: list[str]) -> Any:
        """An observer constructor (PTQ) or a fake-quant constructor around one (QAT) from a plain mapping.

        Args:
            spec: ``{observer, dtype, qscheme, quant_min, quant_max, fake_quant, ...}``; without
                ``quant_min``/``quant_max`` an integer dtype (other than quint4x2) gets its full range.
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        spec = plain(spec)
        if not isinstance(spec, Mapping):
            errors.append(f"{key}={spec!r}: expected a mapping with 'observer', 'dtype', 'qscheme', ...")
            return None
        unknown = sorted(set(spec) - OBS_KEYS)
        if unknown:
            errors.append(f"{key}: unknown field(s) {unknown}; valid: {sorted(OBS_KEYS)}")
        n_err = len(errors)
        kwargs: dict[str, Any] = {k: v for k, v in spec.items() if k in OBS_KEYS - {"fake_quant", "observer"} and v is not None}
        observer_name = spec.get("observer", "moving_average_minmax")
        if observer_name in OBSERVERS:
            observer_cls = getattr(self.tq, OBSERVERS[observer_name])
        elif isinstance(observer_name, str) and observer_name.startswith("torch.ao."):
            observer_cls = resolve_reference(observer_name, f"{key}.observer", errors, self.trusted, kind="observer")
        else:
            errors.append(f"{key}.observer={observer_name!r}: unknown observer{close(observer_name, OBSERVERS)}; valid: {sorted(OBSERVERS)}")
            observer_cls = None
        if "dtype" in kwargs:
            if kwargs["dtype"] not in DTYPES:
                errors.append(f"{key}.dtype={kwargs['dtype']!r}: unknown dtype{close(kwargs['dtype'], DTYPES)}; valid: {sorted(DTYPES)}")
            else:
                kwargs["dtype"] = DTYPES[kwargs["dtype"]]
        if "qscheme" in kwargs:
            if kwargs["qscheme"] not in QSCHEMES:
                errors.append(f"{key}.qscheme={kwargs['qscheme']!r}: unknown qscheme{close(kwargs['qscheme'], QSCHEMES)}; valid: {sorted(QSCHEMES)}")
            else:
                kwargs["qscheme"] = QSCHEMES[kwargs["qscheme"]]
        qmin, qmax = kwargs.get("quant_min"), kwargs.get("quant_max")
        if (qmin is None) != (qmax is None):
            errors.append(f"{key}: give both quant_min and quant_max, or neither")
        elif qmin is not None:
            if not (isinstance(qmin, int) and isinstance(qmax, int)) or qmin >= qmax:
                errors.append(f"{key}: quant_min={qmin!r} must be an integer smaller than quant_max={qmax!r}")
            elif isinstance(kwargs.get("dtype"), torch.dtype) and not kwargs["dtype"].is_floating_point:
                info = torch.iinfo(kwargs["dtype"])
                if qmin < info.min or qmax > info.max:
                    errors.append(
                        f"{key}: [{qmin}, {qmax}] does not fit dtype {spec.get('dtype')} (range [{info.min}, {info.max}])"
                    )
        qscheme = kwargs.get("qscheme")
        if observer_cls is not None and qscheme is not None:
            per_channel_observer = "PerChannel" in observer_cls.__name__
            per_channel_scheme = qscheme in (torch.per_channel_affine, torch.per_channel_symmetric, torch.per_channel_affine_float_qparams)
            if per_channel_scheme != per_channel_observer:
                errors.append(
                    f"{key}: qscheme {spec.get('qscheme')} needs a {'per-channel' if per_channel_scheme else 'per-tensor'} observer, "
                    f"got {observer_name}"
                )
        if "eps" in kwargs:
            kwargs["eps"] = float(kwargs["eps"])
        dtype = kwargs.get("dtype", torch.quint8)
        if qmin is None and isinstance(dtype, torch.dtype) and not dtype.is_floating_point and dtype != torch.quint4x2:
            # fake-quant classes default to [0, 255]; derive the range from the dtype instead
            info = torch.iinfo(dtype)
            kwargs["quant_min"], kwargs["quant_max"] = info.min, info.max
        moving_average = observer_name in ("moving_average_minmax", "moving_average_per_channel_minmax")
        fake_quant = spec.get("fake_quant", ("fused_moving_avg" if moving_average else "fake_quantize") if self.is_qat else None)
        if fake_quant == "fused_moving_avg" and not moving_average and self.is_qat:
            errors.append(f"{key}: fake_quant fused_moving_avg works only with the moving_average_* observers, got "
                          f"{observer_name!r}; use fake_quant: fake_quantize")
        if len(errors) > n_err or observer_cls is None:
            return None
        if fake_quant is None or not self.is_qat:
            return observer_cls.with_args(**{k: v for k, v in kwargs.items() if k not in ("scale", "zero_point", "use_grad_scaling")})
        if fake_quant not in FAKE_QUANTS:
            errors.append(f"{key}.fake_quant={fake_quant!r}: unknown fake-quant{close(fake_quant, FAKE_QUANTS)}; valid: {sorted(FAKE_QUANTS)} or null")
            return None
        fq_cls = resolve_reference(FAKE_QUANTS[fake_quant], f"{key}.fake_quant", errors, kind="observer")
        if fake_quant == "learnable":
            kwargs.setdefault("scale", 0.1)
            kwargs["zero_point"] = float(kwargs.get("zero_point", 0.0))
            kwargs.setdefault("use_grad_scaling", True)
            if qscheme in (torch.per_channel_affine, torch.per_channel_symmetric):
                errors.append(f"{key}: the learnable fake-quant here supports per-tensor qschemes only")
                return None
        return fq_cls.with_args(observer=observer_cls, **kwargs)

    # ---------------------------------------------------------------- one qconfig
    def qconfig(self, spec: Any, key: str, errors: list[str]) -> Any:
        """A ``QConfig`` from a preset name, ``None``/``"none"`` (no quantization, ``None``), or
        ``{activation, weight}``.

        On x86/fbgemm, ranges that would overflow the int16 pair sums of the u8 x s8 kernels are narrowed
        (presets, weights left to the default) or refused (both ranges given).

        Args:
            spec: the qconfig as plain data.
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        spec = plain(spec)
        if spec is None or spec == "none":
            return None
        if isinstance(spec, str):
            if spec == "default":
                return (default_qat_qconfig if self.is_qat else self.tq.get_default_qconfig)(self.backend)
            native = {
                "float16_static": "float16_static_qconfig",
                "float16_dynamic": "float16_dynamic_qconfig",
                "dynamic": "default_dynamic_qconfig",
                "weight_only": "default_weight_only_qconfig",
            }
            if spec in native:
                return getattr(self.tq, native[spec])
            if spec in self.presets:
                return self.qconfig(self._int16_safe(self.presets[spec], preset=True), f"{key} (preset {spec!r})", errors)
            choices = sorted(set(NATIVE_PRESETS) | set(self.presets))
            errors.append(f"{key}={spec!r}: unknown qconfig preset{close(spec, choices)}; valid: {choices} or null")
            return None
        if not isinstance(spec, Mapping) or set(spec) - {"activation", "weight"}:
            errors.append(f"{key}: a qconfig is a preset name, null, or a mapping with 'activation' and 'weight'")
            return None
        spec = self._int16_safe(spec)
        overflow = self._int16_overflow(spec)
        if overflow:  # an explicit activation range: refused, not changed
            errors.append(
                f"{key}: activations [0, {overflow[0]}] with weights up to |{overflow[1]}| overflow the int16 pair sums "
                f"of {self.backend}'s u8 x s8 kernels (fbgemm on CPUs without VNNI: 2 * {overflow[0]} * {overflow[1]} > 32767), "
                f"so int8 would not compute what fake-quant trained; use activation quant_max: 127 (x86's reduce_range), "
                f"weights of 7 bits or fewer, or backend qnnpack"
            )
        activation = self.observer(spec.get("activation", {}), f"{key}.activation", errors)
        weight = self.observer(
            spec.get("weight", DEFAULT_WEIGHT),
            f"{key}.weight", errors,
        )
        if activation is None or weight is None or overflow:
            return None
        return self.tq.QConfig(activation=activation, weight=weight)

    def _int16_overflow(self, spec: Mapping[str, Any]) -> Optional[tuple[int, int]]:
        """``(activation max, weight max |q|)`` when x86/fbgemm's u8 x s8 pair sums (int16) can overflow, else None."""
        if self.backend not in ("x86", "fbgemm"):
            return None
        act, weight = plain(spec.get("activation") or {}), plain(spec.get("weight") or {})
        if not isinstance(act, Mapping) or not isinstance(weight, Mapping):
            return None
        if act.get("dtype", "quint8") != "quint8" or weight.get("dtype", "qint8") != "qint8":
            return None
        bounds = (act.get("quant_max", 127 if act.get("reduce_range") else 255), act.get("quant_min", 0),
                  weight.get("quant_min", -128), weight.get("quant_max", 127))
        if not all(isinstance(b, int) for b in bounds):
            return None  # a malformed range is the observer check's to report
        amax, wabs = bounds[0] - bounds[1], max(-bounds[2], bounds[3])
        return (amax, wabs) if 2 * amax * wabs > 32767 else None

    def _int16_safe(self, spec: Any, preset: bool = False) -> Any:
        """On x86/fbgemm, 7-bit weights ([-64, 63]) where 8-bit weights with full-range activations would overflow
        the kernels' int16 pair sums: for presets (written backend-neutral) and for weights whose range is left to
        the default; when only the weight range is given, activations on [0, 127] (torch.ao's ``reduce_range``);
        when both are given, the spec is kept (and refused by :meth:`qconfig`). Other backends keep all 8 bits.

        Why weights and not activations (torch.ao's own x86 default halves the activations): on all-MiniLM-L6-v2,
        12 steps of linear-only QAT, int8 vs float cosine 0.995 with 7-bit weights against 0.983 with 7-bit
        activations; the digits CNN, int8 vs fake-quant 59.5 against 54.1 dB (same accuracy)."""
        spec = plain(spec)
        if not isinstance(spec, Mapping) or not self._int16_overflow(spec):
            return spec
        activation, weight = plain(spec.get("activation") or {}), plain(spec.get("weight") or {})
        if preset or not {"quant_min", "quant_max"} & set(weight):
            weight = weight if "weight" in spec else dict(DEFAULT_WEIGHT)
            return {**spec, "weight": {**weight, "quant_min": -64, "quant_max": 63}}
        if "quant_max" not in activation:
            activation = {**activation, "quant_min": 0, "quant_max": 127}
            activation.pop("reduce_range", None)
            return {**spec, "activation": activation}
        return spec

    # ---------------------------------------------------------------- the mapping
    def qconfig_mapping(self, spec: Any, key: str, errors: list[str]) -> Any:
        """A ``QConfigMapping`` from plain data: ``global`` (``default`` starts from the backend's default
        mapping), ``object_type``, ``module_name``, ``module_name_regex``, ``module_name_object_type_order``.

        Args:
            spec: the mapping as plain data; ``None`` is ``{global: default}``, a string is the global qconfig.
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        spec = plain(spec)
        mapping = self.tq.QConfigMapping()
        if spec is None:
            spec = {"global": "default"}
        if isinstance(spec, str):
            spec = {"global": spec}
        if not isinstance(spec, Mapping):
            errors.append(f"{key}: expected a mapping with keys {list(MAPPING_KEYS)}")
            return None
        unknown = sorted(set(spec) - set(MAPPING_KEYS))
        if unknown:
            errors.append(f"{key}: unknown key(s) {unknown}; valid: {list(MAPPING_KEYS)}")
        if spec.get("global", "default") == "default":
            # start from the backend's own default mapping (fixed-qparams ops such as sigmoid included)
            mapping = (default_qat_qconfig_mapping if self.is_qat else self.tq.get_default_qconfig_mapping)(self.backend)
        else:
            mapping.set_global(self.qconfig(spec.get("global"), f"{key}.global", errors))
        for i, item in enumerate(spec.get("object_type") or []):
            k = f"{key}.object_type[{i}]"
            if not isinstance(item, Mapping) or set(item) != {"type", "qconfig"}:
                errors.append(f"{k}: expected {{type: <class or function path>, qconfig: <preset|null|mapping>}}")
                continue
            target = resolve_reference(item["type"], f"{k}.type", errors, self.trusted, object_type=True)
            qconfig = self.qconfig(item["qconfig"], f"{k}.qconfig", errors)
            if target is not None:
                mapping.set_object_type(target, qconfig)
        for i, item in enumerate(spec.get("module_name") or []):
            k = f"{key}.module_name[{i}]"
            if not isinstance(item, Mapping) or set(item) != {"name", "qconfig"}:
                errors.append(f"{k}: expected {{name: <submodule name>, qconfig: <preset|null|mapping>}}")
                continue
            mapping.set_module_name(str(item["name"]), self.qconfig(item["qconfig"], f"{k}.qconfig", errors))
        for i, item in enumerate(spec.get("module_name_regex") or []):
            k = f"{key}.module_name_regex[{i}]"
            if not isinstance(item, Mapping) or set(item) != {"regex", "qconfig"}:
                errors.append(f"{k}: expected {{regex: <pattern>, qconfig: <preset|null|mapping>}}")
                continue
            try:
                re.compile(str(item["regex"]))
            except re.error as exc:
                errors.append(f"{k}.regex={item['regex']!r}: not a valid regular expression ({exc})")
                continue
            mapping.set_module_name_regex(str(item["regex"]), self.qconfig(item["qconfig"], f"{k}.qconfig", errors))
        for i, item in enumerate(spec.get("module_name_object_type_order") or []):
            k = f"{key}.module_name_object_type_order[{i}]"
            if not isinstance(item, Mapping) or set(item) != {"module_name", "object_type", "index", "qconfig"}:
                errors.append(f"{k}: expected {{module_name:, object_type:, index:, qconfig:}}")
                continue
            target = resolve_reference(item["object_type"], f"{k}.object_type", errors, self.trusted, object_type=True)
            if not isinstance(item["index"], int) or item["index"] < 0:
                errors.append(f"{k}.index={item['index']!r}: must be a non-negative integer")
                continue
            qconfig = self.qconfig(item["qconfig"], f"{k}.qconfig", errors)
            if target is not None:
                mapping.set_module_name_object_type_order(str(item["module_name"]), target, item["index"], qconfig)
        return mapping

    # ---------------------------------------------------------------- custom configs
    def prepare_custom_config(self, spec: Any, key: str, errors: list[str]) -> Any:
        """A ``PrepareCustomConfig`` from plain data (non-traceable and standalone modules, float-to-observed
        pairs, quantized input/output indexes, preserved attributes).

        Standalone modules get no example inputs here: the engine captures them from a real forward.

        Args:
            spec: the ``prepare`` section as plain data (``None`` for an empty config).
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        from torch.ao.quantization.fx.custom_config import PrepareCustomConfig

        spec = plain(spec) or {}
        config = PrepareCustomConfig()
        config.set_non_traceable_module_names(list(spec.get("non_traceable_module_names") or []))
        classes = [resolve_reference(c, f"{key}.non_traceable_module_classes[{i}]", errors, self.trusted)
                   for i, c in enumerate(spec.get("non_traceable_module_classes") or [])]
        config.set_non_traceable_module_classes([c for c in classes if c is not None])
        for name in spec.get("standalone_module_names") or []:
            # example inputs are captured by the engine from a real forward of the parent
            config.set_standalone_module_name(str(name), None, None, None, None)  # type: ignore[arg-type]
        for i, path in enumerate(spec.get("standalone_module_classes") or []):
            cls = resolve_reference(path, f"{key}.standalone_module_classes[{i}]", errors, self.trusted)
            if cls is not None:
                config.set_standalone_module_class(cls, None, None, None, None)  # type: ignore[arg-type]
        for quant_type, pairs in (spec.get("float_to_observed") or {}).items():
            qt = self._quant_type(quant_type, f"{key}.float_to_observed", errors)
            for i, (f_path, o_path) in enumerate(_pairs(pairs, ("float", "observed"), f"{key}.float_to_observed.{quant_type}", errors)):
                k = f"{key}.float_to_observed.{quant_type}[{i}]"
                f = resolve_reference(f_path, f"{k}.float", errors, self.trusted)
                o = resolve_reference(o_path, f"{k}.observed", errors, self.trusted)
                if f is not None and o is not None and qt is not None:
                    config.set_float_to_observed_mapping(f, o, qt)
        config.set_input_quantized_indexes(list(spec.get("input_quantized_indexes") or []))
        config.set_output_quantized_indexes(list(spec.get("output_quantized_indexes") or []))
        config.set_preserved_attributes(list(spec.get("preserved_attributes") or []))
        return config

    def convert_custom_config(self, spec: Any, key: str, errors: list[str]) -> Any:
        """A ``ConvertCustomConfig`` from plain data (observed-to-quantized pairs, preserved attributes).

        Args:
            spec: the ``convert`` section as plain data (``None`` for an empty config).
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        from torch.ao.quantization.fx.custom_config import ConvertCustomConfig

        spec = plain(spec) or {}
        config = ConvertCustomConfig()
        for quant_type, pairs in (spec.get("observed_to_quantized") or {}).items():
            qt = self._quant_type(quant_type, f"{key}.observed_to_quantized", errors)
            for i, (o_path, q_path) in enumerate(_pairs(pairs, ("observed", "quantized"), f"{key}.observed_to_quantized.{quant_type}", errors)):
                k = f"{key}.observed_to_quantized.{quant_type}[{i}]"
                o = resolve_reference(o_path, f"{k}.observed", errors, self.trusted)
                q = resolve_reference(q_path, f"{k}.quantized", errors, self.trusted)
                if o is not None and q is not None and qt is not None:
                    config.set_observed_to_quantized_mapping(o, q, qt)
        config.set_preserved_attributes(list(spec.get("preserved_attributes") or []))
        return config

    @staticmethod
    def _quant_type(name: str, key: str, errors: list[str]) -> Any:
        from torch.ao.quantization.quant_type import QuantType

        table = {"static": QuantType.STATIC, "dynamic": QuantType.DYNAMIC, "weight_only": QuantType.WEIGHT_ONLY}
        if name not in table:
            errors.append(f"{key}.{name}: unknown quantization type; valid: {sorted(table)}")
            return None
        return table[name]

    def equalization_mapping(self, spec: Any, key: str, errors: list[str]) -> Any:
        """``[module names]`` or ``{global: true}`` -> QConfigMapping of ``default_equalization_qconfig`` (PTQ only).

        Args:
            spec: a list of module names, ``{module_name: [...]}`` or ``{global: true}``; empty gives ``None``.
            key: the config key, for messages.
            errors: list the problems are appended to.
        """
        spec = plain(spec)
        if not spec:
            return None
        from torch.ao.quantization.fx._equalize import default_equalization_qconfig

        mapping = self.tq.QConfigMapping()
        if isinstance(spec, Mapping) and spec.get("global"):
            return mapping.set_global(default_equalization_qconfig)
        names = spec.get("module_name", []) if isinstance(spec, Mapping) else spec
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            errors.append(f"{key}: expected a list of module names or {{global: true}}")
            return None
        for name in names:
            mapping.set_module_name(name, default_equalization_qconfig)
        return mapping

    def backend_config(self, name: Optional[str], key: str, errors: list[str]) -> Any:
        """torch.ao's ``BackendConfig`` by name (``x86``, ``fbgemm``, ``qnnpack``, ``onednn``, ``native``, ``executorch``).

        Args:
            name: the backend config's name; ``None`` gives ``None``.
            key: the config key, for messages.
            errors: list the problem is appended to.
        """
        if name is None:
            return None
        from torch.ao.quantization import backend_config as bc
        from torch.ao.quantization.backend_config.x86 import get_x86_backend_config

        table = {"x86": get_x86_backend_config, "fbgemm": bc.get_fbgemm_backend_config, "qnnpack": bc.get_qnnpack_backend_config,
                 "onednn": bc.get_onednn_backend_config, "native": bc.get_native_backend_config,
                 "executorch": bc.get_executorch_backend_config}
        if name not in table:
            errors.append(f"{key}={name!r}: unknown backend config{close(name, table)}; valid: {sorted(table)}")
            return None
        return table[name]()


def supported_backends(qconfig: Any, module_types: Iterable[type], backends: Iterable[str]) -> list[str]:
    """Backends whose BackendConfig accepts ``qconfig`` for every one of ``module_types``.

    Args:
        qconfig: the ``QConfig`` to check.
        module_types: module classes (a class the BackendConfig has no pattern for does not count against it).
        backends: the backends to try, among ``x86``, ``fbgemm``, ``qnnpack``, ``onednn``.
    """
    from torch.ao.quantization import backend_config as bc
    from torch.ao.quantization.backend_config.x86 import get_x86_backend_config
    from torch.ao.quantization.fx.qconfig_mapping_utils import _is_qconfig_supported_by_dtype_configs

    getters = {"x86": get_x86_backend_config, "fbgemm": bc.get_fbgemm_backend_config,
               "qnnpack": bc.get_qnnpack_backend_config, "onednn": bc.get_onednn_backend_config}
    ok = []
    for backend in backends:
        configs = {c.pattern: c for c in getters[backend]().configs if c.pattern is not None}
        if all(t not in configs or _is_qconfig_supported_by_dtype_configs(qconfig, configs[t].dtype_configs) for t in module_types):
            ok.append(backend)
    return ok


def _pairs(items: Any, fields: tuple[str, str], key: str, errors: list[str]) -> list[tuple[str, str]]:
    """``[{float: A, observed: B}, ...]`` (or a plain ``{A: B}`` mapping from Python) as pairs."""
    if isinstance(items, Mapping):
        return [(str(a), str(b)) for a, b in items.items()]
    out = []
    for i, item in enumerate(items or []):
        if not isinstance(item, Mapping) or set(item) != set(fields):
            errors.append(f"{key}[{i}]: expected {{{fields[0]}: <class path>, {fields[1]}: <class path>}}")
            continue
        out.append((str(item[fields[0]]), str(item[fields[1]])))
    return out


def _names(modules: Mapping[str, torch.nn.Module]) -> list[str]:
    return sorted({n for m in modules.values() for n, _ in m.named_modules() if n})


#: what :func:`check_against_model` calls the two sections: the callbacks' argument names (the config
#: layer passes its own key paths, see :data:`qlightning.config.validate.QUANT_KEYS`)
ARGUMENT_NAMES = {"qconfig_mapping": "qconfig_mapping", "prepare": "prepare_custom_config"}


def check_against_model(modules: Mapping[str, torch.nn.Module], spec: Mapping[str, Any],
                        keys: Mapping[str, str] = ARGUMENT_NAMES) -> list[str]:
    """Entries that match nothing in the quantized submodules, with the closest real names.

    Args:
        modules: each quantized submodule's name to the module; names in the spec are relative to it
            (as FX sees them).
        spec: the plain-data ``qconfig_mapping``, ``prepare`` and ``convert`` sections.
        keys: the names the messages give the ``qconfig_mapping`` and ``prepare`` sections.
    """
    errors: list[str] = []
    names = _names(modules)
    types = {type(m) for root in modules.values() for m in root.modules()}
    type_paths = {f"{t.__module__}.{t.__qualname__}" for t in types}

    def unmatched(key: str, value: str, matched: bool) -> None:
        if not matched:
            hint = difflib.get_close_matches(value, names, n=3, cutoff=0.4)
            errors.append(f"{key}={value!r}: matches no submodule of {sorted(modules)}" + (f"; closest: {hint}" if hint else ""))

    mapping = plain(spec.get("qconfig_mapping"))
    if isinstance(mapping, Mapping):
        for i, item in enumerate(mapping.get("module_name") or []):
            if isinstance(item, Mapping) and "name" in item:
                unmatched(f"{keys['qconfig_mapping']}.module_name[{i}].name", str(item["name"]), str(item["name"]) in names)
        for i, item in enumerate(mapping.get("module_name_regex") or []):
            if isinstance(item, Mapping) and "regex" in item:
                try:
                    pattern = re.compile(str(item["regex"]))
                except re.error:
                    continue
                unmatched(f"{keys['qconfig_mapping']}.module_name_regex[{i}].regex", str(item["regex"]),
                          any(pattern.match(n) for n in names))
        for i, item in enumerate(mapping.get("object_type") or []):
            path = item.get("type") if isinstance(item, Mapping) else None
            if isinstance(path, str) and not path.startswith(("torch.nn.functional.", "operator.")) and path.count(".") >= 2:
                resolved = resolve_reference(path, "", [], object_type=True)
                if isinstance(resolved, type) and issubclass(resolved, torch.nn.Module) and not any(issubclass(t, resolved) for t in types):
                    errors.append(f"{keys['qconfig_mapping']}.object_type[{i}].type={path!r}: no module of this type in {sorted(modules)}; "
                                  f"types present: {sorted(p for p in type_paths if p.startswith('torch.nn.modules'))[:8]}")
    prepare = plain(spec.get("prepare")) or {}
    for key in ("non_traceable_module_names", "standalone_module_names"):
        for i, name in enumerate(prepare.get(key) or []):
            unmatched(f"{keys['prepare']}.{key}[{i}]", str(name), str(name) in names)
    for key in ("non_traceable_module_classes", "standalone_module_classes"):
        for i, path in enumerate(prepare.get(key) or []):
            cls = resolve_reference(path, "", [], object_type=True) if isinstance(path, str) else None
            if isinstance(cls, type) and not any(issubclass(t, cls) for t in types):
                errors.append(f"{keys['prepare']}.{key}[{i}]={path!r}: no module of this class in {sorted(modules)}")
    for quant_type, pairs in (prepare.get("float_to_observed") or {}).items():
        for float_path, _ in _pairs(pairs, ("float", "observed"), "", []):
            cls = resolve_reference(float_path, "", [], object_type=True)
            if isinstance(cls, type) and not any(issubclass(t, cls) for t in types):
                errors.append(f"{keys['prepare']}.float_to_observed.{quant_type}: custom module class {float_path!r} "
                              f"does not occur in {sorted(modules)}")
    return errors
