"""Property-based recipes (hypothesis): valid keys, wrong types, ``_target_`` strings drawn from the
attribute tree of modules in this environment, interpolations and YAML tricks.

Properties, for every generated recipe: no marker file is ever created, and checking it ends
within seconds with OK or a :class:`ConfigError`, never another exception. The check is called
in-process (what ``qlightning recipes validate`` and ``qlightning train`` run before anything is
built); ``tests/test_security.py`` runs the CLI itself on a fixed corpus.
"""

from __future__ import annotations

import pickle
import pkgutil
import tempfile
import time
import types
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from qlightning.config.compose import compose_config  # noqa: E402
from qlightning.config.validate import validate_config  # noqa: E402
from qlightning.errors import ConfigError  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="qlightning-fuzz-"))
MARKER = WORK / "pwned"


class _Touch:
    def __reduce__(self):
        return (open, (str(MARKER), "w"))


EVIL_PICKLE = WORK / "evil.pkl"
EVIL_PICKLE.write_bytes(pickle.dumps({"state_dict": {}, "x": _Touch()}))


def _attribute_paths() -> list[str]:
    """Dotted paths two levels into modules that can run code, read files or reach them."""
    import builtins
    import functools
    import importlib
    import operator
    import os
    import pathlib
    import shutil
    import subprocess

    import hydra.utils
    import lightning.pytorch
    import numpy
    import omegaconf
    import torch
    import torch.nn.modules.module

    import qlightning
    import qlightning.run.app
    import qlightning.examples

    modules = [builtins, functools, importlib, operator, os, pathlib, pickle, shutil, subprocess, hydra, hydra.utils,
               lightning.pytorch, numpy, omegaconf, torch, torch.nn, torch.nn.modules.module, torch.ao.quantization,
               qlightning, qlightning.run.app, qlightning.examples]
    paths: set[str] = set()
    for module in modules:
        for name, value in sorted(vars(module).items())[:3000]:  # torch alone has ~2000 names; load sorts past 600 once more of torch is imported
            paths.add(f"{module.__name__}.{name}")
            if isinstance(value, (types.ModuleType, type)):
                for sub in sorted(vars(value))[:60]:
                    paths.add(f"{module.__name__}.{name}.{sub}")
    # every importable top-level module of the environment, by name only (never imported here)
    for info in list(pkgutil.iter_modules())[:400]:
        paths.update(f"{info.name}.{attr}" for attr in ("load", "system", "run", "loads", "main"))
    return sorted(paths)


PATHS = _attribute_paths()
SAFE_TARGETS = ["qlightning.examples.DigitsClassifier", "qlightning.examples.DigitsDataModule", "torch.nn.Linear"]
PAYLOAD = {"command": f"touch {MARKER}", "args": ["touch", str(MARKER)], "f": str(EVIL_PICKLE), "file": str(EVIL_PICKLE),
           "path": str(MARKER), "weights_only": False, "allow_pickle": True}

targets = st.one_of(st.sampled_from(PATHS), st.sampled_from(SAFE_TARGETS),
                    st.from_regex(r"\A[a-z_]{1,8}(\.[A-Za-z_]{1,8}){0,3}\Z"))
interpolations = st.sampled_from(["${nosuch}", "${oc.env:HOME}", "${oc.env:QLIGHTNING_FUZZ_UNSET}", "${model._target_}",
                                  "${trainer.max_epochs}", "${nosuch_resolver:1}", "${oc.decode:'[1, 2]'}", "${seed}",
                                  "${oc.select:nosuch,3}", "${.}", "${}"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.floats(-2, 3), st.just(float("nan")),
                    st.text(max_size=12), interpolations)
hydra_keys = st.sampled_from(["_partial_", "_args_", "_recursive_", "_convert_", "_target_"])


@st.composite
def obj_node(draw, kind: str) -> dict:
    node: dict = {}
    if draw(st.booleans()):
        node["_target_"] = draw(st.one_of(targets, interpolations, scalars))
    else:
        node["_target_"] = "qlightning.examples.DigitsClassifier" if kind == "model" else "qlightning.examples.DigitsDataModule"
    for key in draw(st.lists(st.sampled_from(sorted(PAYLOAD)), max_size=3, unique=True)):
        node[key] = PAYLOAD[key]
    if draw(st.booleans()):
        node[draw(hydra_keys)] = draw(st.one_of(scalars, st.just([str(MARKER)]), st.builds(dict, _target_=targets, **{"command": st.just(f"touch {MARKER}")})))
    if kind == "model" and draw(st.booleans()):
        node["channels"] = draw(st.lists(st.integers(1, 16), min_size=1, max_size=3))  # small: model size is no subject here
    if kind == "model" and draw(st.booleans()):
        node["lr"] = draw(st.one_of(scalars, st.builds(dict, _target_=targets)))
    return node


@st.composite
def recipes(draw) -> dict:
    recipe: dict = {}
    if draw(st.booleans()):
        recipe["model"] = draw(obj_node("model"))
    if draw(st.booleans()):
        recipe["data"] = draw(obj_node("data"))
    quant: dict = {}
    if draw(st.booleans()):
        quant["modules"] = draw(st.one_of(st.just(["net"]), st.lists(st.one_of(st.text(max_size=6), st.lists(st.just("net"), max_size=2),
                                                                               scalars), max_size=3), scalars))
    if draw(st.booleans()):
        quant["backend"] = draw(st.sampled_from(["x86", "qnnpack", "fbgemm", "onednn", "tensorrt", 3, None]))
    if draw(st.booleans()):
        quant["qconfig_mapping"] = {"object_type": [{"type": draw(targets), "qconfig": None}]}
    if draw(st.booleans()):
        quant["prepare"] = {"non_traceable_module_classes": [draw(targets)]}
    if draw(st.booleans()):
        quant["qconfig_mapping"] = {"global": {"activation": {"observer": draw(targets)}, "weight": {"observer": "minmax"}}}
    if quant:
        recipe["quant"] = quant
    trainer: dict = {}
    for key, values in (("precision", ["32-true", "bf16-mixed", 16, "fp7", 8, "64"]), ("strategy", ["auto", "ddp", "nosuch"]),
                        ("accelerator", ["cpu", "auto", "quantum"]), ("limit_train_batches", [0.5, 2, -1, 1.5, "x", True]),
                        ("val_check_interval", [1.0, 0, 10, 2.5]), ("max_epochs", [1, -1, -5, "three"])):
        if draw(st.booleans()):
            trainer[key] = draw(st.one_of(st.sampled_from(values), scalars))
    if trainer:
        recipe["trainer"] = trainer
    if draw(st.booleans()):
        recipe["ckpt_path"] = draw(st.sampled_from([str(EVIL_PICKLE), "http://127.0.0.1:9/x.ckpt", "s3://b/x", str(WORK / "none"),
                                                     "last", str(WORK)]))
    for key in draw(st.lists(st.sampled_from(["trusted_modules", "hydra", "defaults", "allow_remote_ckpt", "seed", "nosuch",
                                              "report", "_target_"]), max_size=2, unique=True)):
        recipe[key] = draw(st.one_of(scalars, st.just(["os"]), st.just({"callbacks": {"x": {"_target_": "os.system",
                                                                                              "command": f"touch {MARKER}"}}})))
    return recipe


TRICKS = [
    lambda text: text,
    lambda text: "x: &x [1, 2, 3]\ny: [*x, *x, *x]\n" + text,
    lambda text: text + "\n---\nseed: 1\n",
    lambda text: text.replace(": ", ": !!python/object/apply:os.system ['touch " + str(MARKER) + "'] #", 1),
    lambda text: text + "\nz: " + "[" * 80 + "]" * 80 + "\n",
    lambda text: "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefg", "bcdefgh")) + text,
    lambda text: text[: len(text) // 2],  # cut mid-document
    lambda text: text.replace("\n", "\n\t", 1),
    lambda text: "- " + text.replace("\n", "\n  "),  # a list document
    lambda text: "'just a scalar'\n",
]


def check(recipe_text: str, path: Path) -> str:
    """``OK`` or ``ConfigError``; anything else propagates (the property fails)."""
    path.write_text(recipe_text)
    try:
        cfg = compose_config([], recipe=str(path))
        problems, _, _ = validate_config(cfg)
    except ConfigError:
        return "ConfigError"
    return "problems" if problems else "OK"


def _property(recipe: dict, trick: int) -> None:
    text = TRICKS[trick](yaml.safe_dump(recipe, sort_keys=False, allow_unicode=True))
    start = time.perf_counter()
    check(text, WORK / "fuzz.yaml")
    elapsed = time.perf_counter() - start
    assert not MARKER.exists(), text
    assert elapsed < 10, (elapsed, text)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(recipes(), st.integers(0, len(TRICKS) - 1))
def test_generated_recipes_run_nothing_and_end_in_ok_or_a_config_error(recipe, trick):
    _property(recipe, trick)


@pytest.mark.slow  # 200 fresh examples each run (about 35 s on 2 cores), besides the 60 fixed ones above
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(recipes(), st.integers(0, len(TRICKS) - 1))
def test_generated_recipes_many(recipe, trick):
    _property(recipe, trick)


def test_the_attribute_tree_holds_the_dangerous_names():
    """The generator can reach what issue 15 reported (else the property proves little)."""
    for path in ("os.system", "subprocess.Popen", "pickle.loads", "builtins.exec", "operator.methodcaller",
                 "hydra.utils.get_method", "numpy.load", "torch.load", "qlightning.run.app.Path", "torch.nn.modules.module.torch"):
        assert path in PATHS, path
