"""Quantization engines behind one interface; looked up by name, imported only when used."""

from __future__ import annotations

import importlib
from typing import Any, Optional

from qlightning.engines.base import BACKENDS, Inputs, QuantEngine, QuantSpec
from qlightning.errors import ConfigError

#: Each engine and where its class lives (imported only when asked for): the one place an engine is added
ENGINE_CLASSES = {
    "fx": "qlightning.engines.fx.engine:FxEngine",
    "pt2e": "qlightning.engines.pt2e.engine:Pt2eEngine",
}
ENGINES = tuple(ENGINE_CLASSES)
#: ``engine_options.compile``: booleans are on / off
COMPILE_MODES = ("auto", "on", "off")

#: What each engine reads from ``engine_options``: name -> (kind, meaning).
ENGINE_OPTIONS: dict[str, dict[str, tuple[type, str]]] = {
    "fx": {
        "compile": (COMPILE_MODES, "QAT training forwards through torch.compile: auto (when the time it saves on the run's "
                    "remaining steps exceeds the compile time), on, off (default auto)"),
        "fast_qat": (bool, "vectorized fake-quant, fused ReLU, conv-bn and linear paths in training (default true)"),
        "fast_conv_bn": (bool, "conv-bn dividing the weight instead of the conv output (default true)"),
        "fast_linear": (bool, "QAT Linear recomputes its weight fake-quant in backward (default true)"),
        "fast_prepare": (bool, "skip torch.ao's throw-away observer constructions and node stack traces in prepare (default true)"),
        "clamp_activations": (bool, "convert clamps int8 activations to the fake-quant's range, e.g. reduce_range 0..127 (default true)"),
        "trained_qparams": (bool, "convert quantizes with the fake-quants' own scale / zero point buffers, not the observers' recomputation (default true)"),
        "leaf_mode_modules": (bool, "modules whose traced forward would bake self.training in (torchvision StochasticDepth) stay leaves (default true)"),
        "pool_spatial_means": (bool, "int8 x.mean([2, 3]) runs as adaptive_avg_pool2d + flatten (torch's quantized mean fails on 1x1 maps; default true)"),
        "pool_observers": (bool, "average pools and means observe their own output instead of sharing their input's grid, where a mean "
                           "of an even number of codes ties exactly and each runtime breaks the ties its own way (default true)"),
        "split_attention": (bool, "nn.MultiheadAttention runs as four nn.Linear projections (quantized like any Linear) around a float "
                            "attention core, as torch.ao.nn.quantizable.MultiheadAttention splits it; torch.ao FX leaves the module float (default true)"),
        "requantize_as_trained": (bool, "int8 average pools run in float and requantize, dropouts and identities requantize to their trained qparams, as the fake-quant model computes them (default true)"),
    },
    "pt2e": {
        "compile": (COMPILE_MODES, "QAT training forwards through torch.compile: auto (when the time it saves on the run's "
                    "remaining steps exceeds the compile time), on, off (default auto)"),
        "trained_qparams": (bool, "convert quantizes with the fake-quants' own scale / zero point buffers, not the observers' recomputation (default true)"),
        "dynamic_batch": (bool, "export dim 0 of the inputs as a dynamic batch (default true)"),
        "dynamic_dims": (list, "further input dims exported as dynamic, e.g. [1] for a sequence (default [])"),
        "fold_quantize": (bool, "convert_pt2e stores int8 weights (default true)"),
        "fast_fold": (bool, "conv-bn fuse/fold only for the variants in the graph (default true)"),
        "dropout_stochastic_depth": (bool, "torchvision StochasticDepth exported as a dropout, so eval() turns it off (default true)"),
        "split_call_sites": (bool, "each call of a stateless module called at several sites (BasicBlock's relu) is its own partition (default true)"),
        "pool_observers": (bool, "average pools and means observe their own output instead of sharing their input's grid (as the fx "
                           "engine's option; default true)"),
        "quantize_embeddings": (bool, "embedding tables stored as weight-only uint8 rows (torchao EmbeddingQuantizer; default false)"),
        "lean_float_phase": (bool, "with fake-quant off (the float warm-up), per-tensor fake-quants observe their input's min and max "
                             "and return the input itself, without torchao's op copying it (the same state and gradients; default true)"),
    },
}


def check_engine_options(engine: str, options: object, errors: list[str], key: str = "engine_options") -> None:
    """Append a message per unknown option or wrongly typed value of ``engine``'s options.

    Args:
        engine: the engine's name.
        options: the ``engine_options`` given.
        errors: where a message per problem is appended.
        key: what the messages call the options (an argument or a config key).
    """
    if options is None:
        return
    if not hasattr(options, "items"):
        errors.append(f"{key}={options!r}: a mapping of option name to value, e.g. {{fast_qat: false}}")
        return
    known = ENGINE_OPTIONS.get(engine)
    if known is None:
        return
    for name, value in options.items():
        if name not in known:
            errors.append(f"{key}.{name}: unknown option for engine {engine!r}; valid: {sorted(known)}")
        elif isinstance(known[name][0], tuple) and not isinstance(value, bool) and value not in known[name][0]:
            errors.append(f"{key}.{name}={value!r}: one of {list(known[name][0])} (or true / false)")
        elif known[name][0] is bool and not isinstance(value, bool):
            errors.append(f"{key}.{name}={value!r}: true or false")
        elif known[name][0] is list and not (isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value)):
            errors.append(f"{key}.{name}={value!r}: a list of dimension indexes, e.g. [1]")


def compile_mode(options: Any) -> str:
    """``engine_options.compile`` as one of :data:`COMPILE_MODES` (true is on, false off; absent: auto).

    Args:
        options: the ``engine_options`` given (or ``None``).
    """
    value = (options or {}).get("compile", "auto")
    return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value)


def get_engine(name: str) -> QuantEngine:
    """Return the engine called ``name`` (``fx`` or ``pt2e``).

    Importing an engine's module never fails at ``import qlightning`` time; an engine whose
    torch/torchao support is missing raises :class:`~qlightning.errors.EngineUnavailableError` here.

    Args:
        name: a key of :data:`ENGINE_CLASSES`.
    """
    if name not in ENGINE_CLASSES:
        raise ConfigError(f"engine={name!r}: unknown engine; valid choices: {list(ENGINES)}")
    return engine_class(name)()  # type: ignore[misc]


def engine_class(engine: Any) -> Optional[type[QuantEngine]]:
    """The class of ``engine``, a name or an instance, imported but not instantiated (so nothing of torch.ao
    or torchao is loaded); ``None`` for a name that is no engine. Ask it what the engine does (its class
    attributes), rather than comparing names.

    Args:
        engine: an engine's name, or an engine instance.
    """
    if not isinstance(engine, str):
        return type(engine)
    if engine not in ENGINE_CLASSES:
        return None
    module, _, cls = ENGINE_CLASSES[engine].partition(":")
    return getattr(importlib.import_module(module), cls)


def quantized_decomposed_ops() -> Any:
    """``torch.ops.quantized_decomposed`` (the q/dq ops of reference graphs), registered on first use."""
    from qlightning.engines.fx.reference import quantized_decomposed_ops as ops  # lazy: imports torch.ao

    return ops()


__all__ = ["quantized_decomposed_ops", "BACKENDS", "COMPILE_MODES", "ENGINES", "compile_mode", "engine_class", "ENGINE_OPTIONS", "check_engine_options", "Inputs", "QuantEngine", "QuantSpec", "get_engine"]
