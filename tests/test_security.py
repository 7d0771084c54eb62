"""A recipe (or checkpoint) from a stranger is data: it cannot run code, exhaust the machine, or end
in a traceback. Issue 15: each case below reproduces a defect measured on the old code.

Every payload that could run code points at a marker file in a temporary directory, and every
test asserts the marker was never created, the exit status and a fragment of the one message.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from qlightning.cli import main as cli_main
from qlightning.config.build import build_callback
from qlightning.config.compose import compose_config
from qlightning.config.validate import validate_config
from qlightning.errors import ConfigError
from qlightning.examples import DigitsClassifier

ROOT = Path(__file__).resolve().parents[1]


class _Touch:
    """Unpickling this creates the marker file (``open(marker, "w")``): the stand-in for any code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# ------------------------------------------------------------------ checkpoints to resume from


def _qat_checkpoint(path: Path, model=None, backend: str = "x86", **state_changes) -> Path:
    """A checkpoint as ``qlightning train`` writes it (prepared state_dict + the callback's state), no training."""
    cfg = compose_config([f"quant.backend={backend}"])
    callback = build_callback(cfg)
    lm = model if model is not None else DigitsClassifier()
    callback.prepare(lm)
    state = {**callback.state_dict(), **state_changes}
    torch.save({"epoch": 0, "global_step": 0, "state_dict": lm.state_dict(), "callbacks": {callback.state_key: state}}, path)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Checkpoints and pickles, good and bad; the marker of every pickle payload is ``marker``."""
    d = tmp_path_factory.mktemp("files")
    marker = d / "pwned"
    out = {"dir": d, "marker": marker}
    out["good"] = _qat_checkpoint(d / "good.ckpt")
    data = out["good"].read_bytes()
    (d / "truncated.ckpt").write_bytes(data[: len(data) // 2])
    out["truncated"] = d / "truncated.ckpt"
    out["foreign_model"] = _qat_checkpoint(d / "foreign_model.ckpt", model=DigitsClassifier(channels=[8, 16, 32]))
    out["foreign_backend"] = _qat_checkpoint(d / "foreign_backend.ckpt", backend="qnnpack")
    out["foreign_engine"] = _qat_checkpoint(d / "foreign_engine.ckpt", engine="pt2e")
    out["foreign_modules"] = _qat_checkpoint(d / "foreign_modules.ckpt", modules=["classifier"])
    torch.save({"state_dict": DigitsClassifier().state_dict(), "callbacks": {}}, d / "float.ckpt")
    out["float"] = d / "float.ckpt"
    torch.save(42, d / "scalar.ckpt")
    out["scalar"] = d / "scalar.ckpt"
    (d / "text.ckpt").write_text("this is not a checkpoint\n")
    out["text"] = d / "text.ckpt"
    (d / "empty.ckpt").write_bytes(b"")
    out["empty"] = d / "empty.ckpt"
    (d / "legacy_pickle.ckpt").write_bytes(pickle.dumps({"state_dict": {}, "x": _Touch(str(marker))}))
    out["legacy_pickle"] = d / "legacy_pickle.ckpt"
    torch.save({"state_dict": {}, "x": _Touch(str(marker))}, d / "zip_pickle.ckpt")
    out["zip_pickle"] = d / "zip_pickle.ckpt"
    import numpy as np

    np.save(d / "evil.npy", np.array([_Touch(str(marker))], dtype=object), allow_pickle=True)
    out["npy"] = d / "evil.npy"
    (d / "adir.ckpt").mkdir()
    out["adir"] = d / "adir.ckpt"
    assert not marker.exists()
    return out


# ------------------------------------------------------------------ the hostile and bad corpus
# (name, recipe text, message fragment). Placeholders: {marker}, {pkl}, {npy}, {ckpt_*}.

M = "model:\n  _target_: {target}\n"


def _target_case(name: str, target: str, fragment: str = "not an allowed class", extra: str = "") -> tuple[str, str, str]:
    body = f"model:\n  _target_: {target}\n{extra}"
    return name, body, fragment


TOUCH_ARGS = "  command: 'touch {marker}'\n  args: ['touch', '{marker}']\n  f: '{pkl}'\n  file: '{npy}'\n  path: '{marker}'\n"

TARGETS = [
    # attribute walks through a module's imports (the reported routes)
    _target_case("walk_module_torch_load", "torch.nn.modules.module.torch.load",
                 "is a module reached as an attribute", "  f: '{pkl}'\n  weights_only: false\n"),
    _target_case("walk_app_path_write_text", "qlightning.run.app.Path.write_text", "not an allowed class",
                 "  self: '{marker}'\n  data: 'import os'\n"),
    _target_case("walk_app_pickle_loads", "qlightning.run.app.pickle.loads", "not an allowed class"),
    _target_case("walk_app_torch_load", "qlightning.run.app.torch.load", "not an allowed class", "  f: '{pkl}'\n  weights_only: false\n"),
    _target_case("walk_examples_torch_load", "qlightning.examples.digits.torch.load", "is a module reached as an attribute",
                 "  f: '{pkl}'\n  weights_only: false\n"),
    _target_case("walk_examples_pl", "qlightning.examples.digits.pl.LightningModule", "is a module reached as an attribute"),
    _target_case("walk_torch_os_system", "torch.os.system", "not an allowed class", "  command: 'touch {marker}'\n"),
    _target_case("walk_module_save", "torch.nn.modules.module.torch.save", "is a module reached as an attribute"),
    _target_case("walk_functional_torch", "torch.nn.functional.torch.load", "is a module reached as an attribute"),
    _target_case("numpy_load_pickle", "numpy.load", "not an allowed class", "  file: '{npy}'\n  allow_pickle: true\n"),
    _target_case("numpy_save", "numpy.save", "not an allowed class", "  file: '{marker}'\n  arr: [1]\n"),
    _target_case("os_system", "os.system", "not an allowed class", "  command: 'touch {marker}'\n"),
    _target_case("posix_system", "posix.system", "not an allowed class", "  command: 'touch {marker}'\n"),
    _target_case("os_popen", "os.popen", "not an allowed class", "  cmd: 'touch {marker}'\n"),
    _target_case("subprocess_run", "subprocess.run", "not an allowed class", "  args: ['touch', '{marker}']\n"),
    _target_case("subprocess_popen", "subprocess.Popen", "not an allowed class", "  args: ['touch', '{marker}']\n"),
    _target_case("subprocess_check_call", "subprocess.check_call", "not an allowed class", "  args: ['touch', '{marker}']\n"),
    _target_case("builtins_exec", "builtins.exec", "not an allowed class", "  source: 'open(\"{marker}\", \"w\")'\n"),
    _target_case("builtins_eval", "builtins.eval", "not an allowed class", "  source: 'open(\"{marker}\", \"w\")'\n"),
    _target_case("builtins_open", "builtins.open", "not an allowed class", "  file: '{marker}'\n  mode: w\n"),
    _target_case("builtins_import", "builtins.__import__", "not an allowed class", "  name: os\n"),
    _target_case("pickle_loads", "pickle.loads", "not an allowed class"),
    _target_case("pickle_load", "pickle.load", "not an allowed class"),
    _target_case("operator_methodcaller", "operator.methodcaller", "not an allowed class", "  name: system\n"),
    _target_case("operator_attrgetter", "operator.attrgetter", "not an allowed class", "  attr: system\n"),
    _target_case("hydra_get_method", "hydra.utils.get_method", "not an allowed class", "  path: os.system\n"),
    _target_case("hydra_get_class", "hydra.utils.get_class", "not an allowed class", "  path: subprocess.Popen\n"),
    _target_case("hydra_instantiate", "hydra.utils.instantiate", "not an allowed class",
                 "  config: {{_target_: os.system, command: 'touch {marker}'}}\n"),
    _target_case("hydra_internal_call", "hydra._internal.utils._locate", "not an allowed class", "  path: os.system\n"),
    _target_case("importlib_import", "importlib.import_module", "not an allowed class", "  name: os\n"),
    _target_case("runpy_run_path", "runpy.run_path", "not an allowed class", "  path_name: '{marker}'\n"),
    _target_case("shutil_rmtree", "shutil.rmtree", "not an allowed class", "  path: '{marker}'\n"),
    _target_case("torch_load", "torch.load", "not an allowed class", "  f: '{pkl}'\n  weights_only: false\n"),
    _target_case("torch_serialization_load", "torch.serialization.load", "not an allowed class", "  f: '{pkl}'\n  weights_only: false\n"),
    _target_case("torch_save", "torch.save", "not an allowed class", "  obj: 1\n  f: '{marker}'\n"),
    _target_case("torch_jit_load", "torch.jit.load", "not an allowed class", "  f: '{pkl}'\n"),
    _target_case("torch_hub_load", "torch.hub.load", "not an allowed class", "  repo_or_dir: x\n  model: y\n"),
    _target_case("torch_from_file", "torch.from_file", "not an allowed class", "  filename: '{marker}'\n  shared: true\n  size: 8\n"),
    _target_case("torch_cpp_extension", "torch.utils.cpp_extension.load_inline", "not an allowed class"),
    _target_case("torch_ops_aten", "torch.ops.aten.save", "not an allowed class"),
    _target_case("pathlib_write_text", "pathlib.Path.write_text", "not an allowed class", "  self: '{marker}'\n  data: x\n"),
    _target_case("pathlib_touch", "pathlib.Path.touch", "not an allowed class", "  self: '{marker}'\n"),
    _target_case("functools_partial", "functools.partial", "not an allowed class", "  func: os.system\n"),
    _target_case("lightning_checkpoint_writes_files", "lightning.pytorch.callbacks.ModelCheckpoint", "not an allowed class",
                 "  dirpath: '{marker}'\n"),
    _target_case("lightning_logger_writes_files", "lightning.pytorch.loggers.CSVLogger", "not an allowed class", "  save_dir: '{marker}'\n"),
    _target_case("load_from_checkpoint_classmethod", "qlightning.examples.DigitsClassifier.load_from_checkpoint",
                 "not an allowed class", "  checkpoint_path: '{pkl}'\n  weights_only: false\n"),
    _target_case("lightning_load_from_checkpoint", "lightning.pytorch.LightningModule.load_from_checkpoint", "not an allowed class",
                 "  checkpoint_path: '{pkl}'\n"),
    _target_case("module_load_state_dict", "torch.nn.modules.module.Module.load_state_dict", "not an allowed class"),
    _target_case("qlightning_restore", "qlightning.callbacks.checkpoint.restore", "not an allowed class", "  checkpoint_path: '{pkl}'\n"),
    _target_case("qlightning_cli_main", "qlightning.cli.main", "not an allowed class", "  argv: ['recipes', 'cp', 'digits_fast', '{marker}']\n"),
    _target_case("qlightning_train", "qlightning.run.app.train", "not an allowed class", "  run_dir: '{marker}'\n"),
    _target_case("qlightning_recipes_cp", "qlightning.cli.recipes.main", "not an allowed class"),
    _target_case("class_dunder", "qlightning.examples.DigitsClassifier.__class__", "not an allowed class"),
    _target_case("class_init", "qlightning.examples.DigitsClassifier.__init__", "not an allowed class"),
    _target_case("sys_modules", "sys.modules", "not an allowed class"),
    _target_case("typing_cast", "typing.cast", "not an allowed class"),
    _target_case("not_a_lightning_module", "qlightning.examples.digits.DigitsCNN", "not an allowed class"),
    _target_case("a_function", "qlightning.examples.digits.conv_bn_relu", "not an allowed class"),
    _target_case("torch_nn_linear_as_model", "torch.nn.Linear", "not an allowed class", "  in_features: 1\n  out_features: 1\n"),
    _target_case("no_such_module", "nosuchpkg.Evil", "not an allowed class"),
    _target_case("no_such_class", "qlightning.examples.NoSuchModel", "cannot be resolved"),
    _target_case("bare_name", "eval", "give a dotted path"),
    _target_case("empty_string", "''", "give a dotted path"),
    _target_case("double_dot", "qlightning..examples", "give a dotted path"),
    _target_case("trailing_space", "'qlightning.examples.DigitsClassifier '", "give a dotted path"),
    _target_case("call_syntax", "'os.system(\"touch {marker}\")'", "give a dotted path"),
    _target_case("int_target", "42", "not an allowed class"),
    _target_case("list_target", "[os.system]", "not an allowed class"),
    _target_case("map_target", "{{a: os.system}}", "not an allowed class"),
    _target_case("null_target", "null", "not an allowed class"),
    ("data_subprocess", "data:\n  _target_: subprocess.run\n  args: ['touch', '{marker}']\n", "not an allowed class"),
    ("data_is_a_model", "data:\n  _target_: qlightning.examples.DigitsClassifier\n", "not an allowed class"),
    ("data_walk", "data:\n  _target_: qlightning.examples.digits.torch.load\n  f: '{pkl}'\n", "is a module reached as an attribute"),
]

HYDRA_GAMES = [
    ("partial", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  _partial_: true\n", "_partial_ is a Hydra instantiation keyword"),
    ("args", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  _args_: ['{marker}']\n", "_args_ is a Hydra instantiation keyword"),
    ("recursive", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  _recursive_: false\n", "_recursive_ is a Hydra"),
    ("convert", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  _convert_: object\n", "_convert_ is a Hydra"),
    ("nested_target_arg", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  lr: {{_target_: os.system, command: 'touch {marker}'}}\n",
     "_target_ is allowed only as"),
    ("nested_allowed_class", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  lr: {{_target_: qlightning.examples.DigitsClassifier}}\n",
     "_target_ is allowed only as"),
    ("nested_in_list", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  channels: [{{_target_: os.system, command: 'touch {marker}'}}]\n",
     "_target_ is allowed only as"),
    ("target_in_engine_options", "quant:\n  engine_options:\n    x: {{_target_: os.system, command: 'touch {marker}'}}\n", "_target_ is allowed only as"),
    ("target_at_top", "_target_: os.system\ncommand: 'touch {marker}'\n", "_target_ is allowed only as"),
    ("target_in_data_arg", "data:\n  _target_: qlightning.examples.DigitsDataModule\n  batch_size: {{_target_: os.system, command: 'touch {marker}'}}\n",
     "_target_ is allowed only as"),
    ("target_env_interp", "model:\n  _target_: ${{oc.env:EVIL_TARGET}}\n  command: 'touch {marker}'\n", "no interpolation"),
    ("target_decode_interp", "model:\n  _target_: \"${{oc.decode:'os.system'}}\"\n  command: 'touch {marker}'\n", "no interpolation"),
    ("target_self_interp", "evil: os.system\nmodel:\n  _target_: ${{evil}}\n  command: 'touch {marker}'\n", "no interpolation"),
]

FORBIDDEN = [
    ("widen_allowlist", "trusted_modules: [os, subprocess]\nmodel:\n  _target_: os.system\n  command: 'touch {marker}'\n", "which a recipe may not set"),
    ("allow_remote_from_recipe", "allow_remote_ckpt: true\nckpt_path: 'http://127.0.0.1:9/evil.ckpt'\n", "which a recipe may not set"),
    ("hydra_callback", "hydra:\n  callbacks:\n    evil:\n      _target_: os.system\n      command: 'touch {marker}'\n", "which a recipe may not set"),
    ("hydra_env", "hydra:\n  job:\n    env_set:\n      LD_PRELOAD: /tmp/evil.so\n", "which a recipe may not set"),
    ("defaults_list", "defaults:\n  - override /model: digits_cnn\n", "which a recipe may not set"),
    ("object_type_os", "quant:\n  qconfig_mapping:\n    object_type: [{{type: os.system, qconfig: null}}]\n", "not an allowed class"),
    ("object_type_walk", "quant:\n  qconfig_mapping:\n    object_type: [{{type: torch.nn.modules.module.torch.load, qconfig: null}}]\n",
     "is a module reached as an attribute"),
    ("object_type_methodcaller", "quant:\n  qconfig_mapping:\n    object_type: [{{type: operator.methodcaller, qconfig: null}}]\n",
     "not an allowed class"),
    ("object_type_torch_load", "quant:\n  qconfig_mapping:\n    object_type: [{{type: torch.load, qconfig: null}}]\n", "not an allowed class"),
    ("order_object_type_os", "quant:\n  qconfig_mapping:\n    module_name_object_type_order: [{{module_name: '', object_type: subprocess.Popen, index: 0, qconfig: null}}]\n",
     "not an allowed class"),
    ("custom_class_subprocess", "quant:\n  prepare:\n    non_traceable_module_classes: [subprocess.Popen]\n", "not an allowed class"),
    ("standalone_class_walk", "quant:\n  prepare:\n    standalone_module_classes: [qlightning.run.app.Path]\n", "not an allowed class"),
    ("custom_module_pickle", "quant:\n  prepare:\n    float_to_observed:\n      static: [{{float: pickle.Unpickler, observed: torch.nn.Linear}}]\n",
     "not an allowed class"),
    ("convert_custom_os", "quant:\n  convert:\n    observed_to_quantized:\n      static: [{{observed: torch.nn.Linear, quantized: os._wrap_close}}]\n",
     "not an allowed class"),
    ("observer_not_an_observer", "quant:\n  qconfig_mapping:\n    global: {{activation: {{observer: torch.ao.quantization.quantize_fx.prepare_fx}}, weight: {{observer: minmax}}}}\n",
     "not an allowed class"),
    ("observer_walk", "quant:\n  qconfig_mapping:\n    global: {{activation: {{observer: torch.ao.quantization.observer.torch.load}}, weight: {{observer: minmax}}}}\n",
     "is a module reached as an attribute"),
]

BOMB_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))
YAML_TRICKS = [
    ("billion_laughs", BOMB_LAUGHS, "more than 10000 nodes once aliases are expanded"),
    ("many_aliases", "a: &a 1\nb: [" + ", ".join(["*a"] * 1500) + "]\n", "more than 1000 alias uses"),
    ("many_keys", "".join(f"k{i}: {i}\n" for i in range(30000)), "more than 10000 nodes"),
    ("huge_file", "seed: 0\n" + "#" * (1 << 21) + "\n", "above the limit of 1048576 bytes"),
    ("deep_nesting", "a: " + "[" * 200 + "]" * 200 + "\n", "nesting deeper than 64 levels"),
    ("deep_mapping", "".join("  " * i + f"k{i}:\n" for i in range(100)) + "  " * 100 + "v: 1\n", "nesting deeper than 64 levels"),
    ("recursive_alias", "a: &a [*a]\n", "once aliases are expanded"),
    ("scalar_document", "just a string\n", "must be a mapping of config keys"),
    ("int_document", "42\n", "must be a mapping of config keys"),
    ("list_document", "- seed: 1\n", "must be a mapping of config keys"),
    ("empty_document", "", "got an empty document"),
    ("comment_only", "# nothing\n", "got an empty document"),
    ("two_documents", "seed: 1\n---\nseed: 2\n", "not valid YAML: expected a single document"),
    ("python_object_apply", "model: !!python/object/apply:os.system ['touch {marker}']\n", "not valid YAML"),
    ("python_name", "model: !!python/name:os.system\n", "not valid YAML"),
    ("python_module", "model: !!python/module:os\n", "not valid YAML"),
    ("custom_tag", "seed: !evil 1\n", "not valid YAML"),
    ("binary_tag", "seed: !!binary aGVsbG8=\n", "seed: Value 'b'hello'' of type 'bytes' could not be converted"),
    ("timestamp", "seed: 2001-12-14\n", "not a config OmegaConf can hold"),
    ("set_tag", "seed: !!set {{a, b}}\n", "not a config OmegaConf can hold"),
    ("int_key", "1: x\n", "top-level keys must be strings"),
    ("complex_key", "? [a, b]\n: c\n", "not valid YAML"),
    ("tab_indent", "quant:\n\tbackend: x86\n", "not valid YAML"),
    ("unclosed_quote", "seed: 'abc\n", "not valid YAML"),
    ("bad_utf8", b"seed: \xff\xfe\n", "cannot read as UTF-8"),
    ("merge_key_bomb", "a: &a {{x: 1, y: 2}}\nb: {{<<: *a, z: 3}}\nc: " + "[" + ", ".join(["*a"] * 1200) + "]\n", "more than 1000 alias uses"),
]

INTERPOLATIONS = [
    ("missing_key", "trainer:\n  max_epochs: ${{nosuch}}\n", "trainer.max_epochs: cannot resolve"),
    ("missing_nested_key", "report:\n  latency_repeats: ${{trainer.nosuch}}\n", "report.latency_repeats: cannot resolve"),
    ("unset_env", "seed: ${{oc.env:QLIGHTNING_TEST_SURELY_UNSET}}\n", "seed: cannot resolve"),
    ("unknown_resolver", "seed: ${{nosuch_resolver:1}}\n", "seed: cannot resolve"),
    ("model_arg_missing", "model:\n  _target_: qlightning.examples.DigitsClassifier\n  lr: ${{data.nosuch}}\n", "model.lr: cannot resolve"),
    ("self_cycle", "report:\n  latency_repeats: ${{report.latency_repeats}}\n", "report.latency_repeats: cannot resolve"),
    ("modules_env", "quant:\n  modules: ${{oc.env:QLIGHTNING_TEST_SURELY_UNSET}}\n", "quant.modules: cannot resolve"),
]

TRAINER = [
    ("precision_fp7", "trainer:\n  precision: fp7\n", "trainer.precision='fp7': not a value Lightning accepts"),
    ("precision_8", "trainer:\n  precision: 8\n", "trainer.precision=8: not a value Lightning accepts"),
    ("accelerator_bad", "trainer:\n  accelerator: quantum\n", "trainer.accelerator='quantum': not a value Lightning accepts"),
    ("strategy_nosuch", "trainer:\n  strategy: nosuch\n", "trainer.strategy='nosuch': not a value Lightning accepts"),
    ("strategy_typo", "trainer:\n  strategy: ddp_spwn\n", "did you mean 'ddp_spawn'"),
    ("limit_negative", "trainer:\n  limit_train_batches: -1\n", "trainer.limit_train_batches=-1"),
    ("limit_fraction", "trainer:\n  limit_val_batches: 1.5\n", "trainer.limit_val_batches=1.5"),
    ("limit_string", "trainer:\n  limit_test_batches: lots\n", "trainer.limit_test_batches='lots'"),
    ("limit_bool", "trainer:\n  limit_train_batches: true\n", "trainer.limit_train_batches=True"),
    ("val_check_zero", "trainer:\n  val_check_interval: 0\n", "trainer.val_check_interval=0"),
    ("val_check_fraction", "trainer:\n  val_check_interval: 2.5\n", "trainer.val_check_interval=2.5"),
    ("max_epochs_negative", "trainer:\n  max_epochs: -5\n", "trainer.max_epochs=-5: must be an integer >= -1"),
    ("devices_zero", "trainer:\n  devices: 0\n", "trainer.devices=0"),
    ("log_every_zero", "trainer:\n  log_every_n_steps: 0\n", "trainer.log_every_n_steps=0"),
    ("accumulate_zero", "trainer:\n  accumulate_grad_batches: 0\n", "trainer.accumulate_grad_batches=0"),
    ("clip_negative", "trainer:\n  gradient_clip_val: -1.0\n", "trainer.gradient_clip_val=-1.0"),
    ("num_nodes_zero", "trainer:\n  num_nodes: 0\n", "trainer.num_nodes=0"),
    ("deterministic_maybe", "trainer:\n  deterministic: maybe\n", "trainer.deterministic='maybe'"),
    ("schema_and_semantic", "trainer:\n  max_epoch: 3\n  precision: fp7\n", "precision='fp7'"),
]

MODULES = [
    ("modules_nested", "quant:\n  modules: [[net]]\n", "quant.modules[0]=['net']: each entry must be one submodule name"),
    ("modules_nested_mixed", "quant:\n  modules: [net, [classifier]]\n", "quant.modules[1]=['classifier']"),
    ("modules_empty_name", "quant:\n  modules: ['']\n", "quant.modules[0]=''"),
]

CHECKPOINTS = [
    ("ckpt_http", "ckpt_path: 'http://127.0.0.1:9/evil.ckpt'\n", "a remote checkpoint is refused"),
    ("ckpt_https", "ckpt_path: 'https://example.invalid/evil.ckpt'\n", "a remote checkpoint is refused"),
    ("ckpt_s3", "ckpt_path: 's3://bucket/evil.ckpt'\n", "a remote checkpoint is refused"),
    ("ckpt_file_url", "ckpt_path: 'file://{pkl}'\n", "a remote checkpoint is refused"),
    ("ckpt_interpolated", "ckpt_path: ${{oc.env:EVIL_URL}}\n", "a remote checkpoint is refused in a recipe"),
    ("ckpt_url_recipe_even_with_flag", "ckpt_path: 'http://127.0.0.1:9/evil.ckpt'\n", "a remote checkpoint is refused in a recipe"),
    ("ckpt_registry", "ckpt_path: registry\n", "give the path of a checkpoint file"),
    ("ckpt_last", "ckpt_path: last\n", "give the path of a checkpoint file"),
    ("ckpt_missing", "ckpt_path: '{dir}/nosuch.ckpt'\n", "nosuch.ckpt': no such file"),
    ("ckpt_directory", "ckpt_path: '{ckpt_adir}'\n", "adir.ckpt': not a file"),
    ("ckpt_truncated", "ckpt_path: '{ckpt_truncated}'\n", "truncated.ckpt': not a readable PyTorch checkpoint"),
    ("ckpt_text", "ckpt_path: '{ckpt_text}'\n", "text.ckpt': not a"),
    ("ckpt_empty", "ckpt_path: '{ckpt_empty}'\n", "empty.ckpt': not a readable PyTorch checkpoint"),
    ("ckpt_scalar", "ckpt_path: '{ckpt_scalar}'\n", "scalar.ckpt': not a Lightning checkpoint"),
    ("ckpt_legacy_pickle", "ckpt_path: '{ckpt_legacy_pickle}'\n", "holds objects other than tensors and plain data"),
    ("ckpt_zip_pickle", "ckpt_path: '{ckpt_zip_pickle}'\n", "holds objects other than tensors and plain data"),
    ("ckpt_numpy_pickle", "ckpt_path: '{npy}'\n", "evil.npy'"),
    ("ckpt_float_run", "ckpt_path: '{ckpt_float}'\n", "saved by a run without qlightning's callback"),
    ("ckpt_foreign_model", "ckpt_path: '{ckpt_foreign_model}'\n", "saved from another model than this config builds"),
    ("ckpt_foreign_backend", "ckpt_path: '{ckpt_foreign_backend}'\n", "trained with quant.backend='qnnpack', this config has quant.backend='x86'"),
    ("ckpt_foreign_engine", "ckpt_path: '{ckpt_foreign_engine}'\n", "trained with quant.engine='pt2e'"),
    ("ckpt_foreign_modules", "ckpt_path: '{ckpt_foreign_modules}'\n", "trained with quantized modules ['classifier']"),
    ("ckpt_with_other_errors", "ckpt_path: '{dir}/nosuch.ckpt'\ntrainer:\n  precision: fp7\n", "no such file"),
]

CORPUS = TARGETS + HYDRA_GAMES + FORBIDDEN + YAML_TRICKS + INTERPOLATIONS + TRAINER + MODULES + CHECKPOINTS
assert len({name for name, _, _ in CORPUS}) == len(CORPUS) >= 100, len(CORPUS)


def _fill(text, files) -> str | bytes:
    if isinstance(text, bytes):
        return text
    values = {"marker": files["marker"], "pkl": files["legacy_pickle"], "npy": files["npy"], "dir": files["dir"]}
    values.update({f"ckpt_{k}": v for k, v in files.items() if isinstance(v, Path)})
    return text.format(**values)


@pytest.mark.parametrize("name, text, fragment", CORPUS, ids=[c[0] for c in CORPUS])
def test_hostile_or_bad_recipe_is_one_clear_message_and_runs_nothing(name, text, fragment, files, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EVIL_TARGET", "os.system")
    monkeypatch.setenv("EVIL_URL", "http://127.0.0.1:9/evil.ckpt")
    monkeypatch.delenv("QLIGHTNING_TEST_SURELY_UNSET", raising=False)
    recipe = tmp_path / f"{name}.yaml"
    filled = _fill(text, files)
    recipe.write_bytes(filled if isinstance(filled, bytes) else filled.encode())
    start = time.perf_counter()
    flags = ["allow_remote_ckpt=true"] if name.endswith("_with_flag") else []
    code = cli_main(["recipes", "validate", str(recipe), *flags])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert not files["marker"].exists(), f"{name}: the payload ran"
    assert code == 1, err
    assert fragment in err, err
    assert "Traceback" not in err
    assert elapsed < 20, f"{name}: {elapsed:.1f} s"


def test_a_good_checkpoint_passes_the_check(files, tmp_path, capsys):
    recipe = tmp_path / "resume.yaml"
    recipe.write_text(f"ckpt_path: '{files['good']}'\n")
    assert cli_main(["recipes", "validate", str(recipe)]) == 0, capsys.readouterr().err


def test_remote_checkpoint_from_the_command_line_needs_the_flag_and_is_checked_as_plain_data(files, tmp_path):
    """A URL is fetched only with allow_remote_ckpt=true, then checked with weights_only=True, and
    Lightning gets the local copy; a pickle served over HTTP never runs."""
    import http.server
    import threading

    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(files["dir"]), **kwargs)

        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        refused, _, _ = validate_config(compose_config([f"ckpt_path={base}/good.ckpt"]))
        assert any("a remote checkpoint is refused" in p for p in refused) and not requests
        cfg = compose_config([f"ckpt_path={base}/good.ckpt", "allow_remote_ckpt=true"])
        problems, _, _ = validate_config(cfg)
        assert problems == [] and requests
        assert Path(cfg.ckpt_path).is_file() and not cfg.ckpt_path.startswith("http")  # Lightning reads the checked copy
        evil, _, _ = validate_config(compose_config([f"ckpt_path={base}/zip_pickle.ckpt", "allow_remote_ckpt=true"]))
        assert any("holds objects other than tensors" in p for p in evil), evil
        assert not files["marker"].exists()
    finally:
        server.shutdown()


def test_trusted_modules_cannot_come_from_a_recipe_but_can_from_the_command_line(tmp_path, monkeypatch):
    pkg = tmp_path / "teamnets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import os
        from os import system
        from qlightning.examples import DigitsClassifier

        class Net(DigitsClassifier):
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "team.yaml"
    recipe.write_text("model:\n  _target_: teamnets.Net\n")
    from qlightning.cli.recipes import validate

    assert any("not an allowed class" in p for p in validate(str(recipe)))
    assert validate(str(recipe), ["trusted_modules=[teamnets]"]) == []
    # trusting a package does not trust what it imported
    for target in ("teamnets.system", "teamnets.os.system"):
        recipe.write_text(f"model:\n  _target_: {target}\n  command: 'touch {tmp_path}/pwned'\n")
        assert any("not an allowed class" in p for p in validate(str(recipe), ["trusted_modules=[teamnets]"])), target
    assert not (tmp_path / "pwned").exists()


def test_schema_and_semantic_errors_come_in_one_round(capsys):
    code = cli_main(["recipes", "validate", "digits_fast", "trainer.max_epoch=3", "trainer.precision=fp7",
                     "trainer.strategy=nosuch", "+quant.nosuch=1"])
    err = capsys.readouterr().err
    assert code == 1
    for fragment in ("did you mean 'max_epochs'", "trainer.precision='fp7'", "trainer.strategy='nosuch'", "nosuch"):
        assert fragment in err, err


def test_trainer_values_lightning_accepts_pass():
    for overrides in (["trainer.precision=bf16-mixed"], ["trainer.precision=16"], ["trainer.strategy=ddp_spawn"],
                      ["trainer.accelerator=auto"], ["trainer.limit_train_batches=0.5", "trainer.val_check_interval=10"]):
        problems, _, _ = validate_config(compose_config(overrides))
        assert problems == [], (overrides, problems)


BOMB_SCRIPT = """
import resource, sys, time, tracemalloc
from pathlib import Path
from qlightning import recipes_registry
from qlightning.errors import ConfigError
for name in sys.argv[1:]:
    recipe = recipes_registry.Recipe("bomb", Path(name), "file")
    def load():
        try:
            recipes_registry.load(recipe)
            return "loaded"
        except ConfigError as exc:
            return str(exc)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu = time.perf_counter(), time.process_time()
    outcome = load()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()  # a second run under tracemalloc (it slows allocation, so it is not the timed one)
    load()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"{Path(name).stem} {elapsed:.3f} {cpu:.3f} {peak} {(after - before) * 1024}")
    print(outcome.replace(chr(10), " "))
"""
BOMBS = ["billion_laughs", "many_keys", "many_aliases", "merge_key_bomb", "deep_nesting", "deep_mapping"]


def test_yaml_bombs_are_refused_fast_with_bounded_memory(tmp_path):
    """On the old code the billion-laughs and many-key files ran for minutes at gigabytes (timeout here)."""
    texts = dict((n, t) for n, t, _ in YAML_TRICKS)
    paths = []
    for name in BOMBS:
        (tmp_path / f"{name}.yaml").write_text(texts[name].replace("{{", "{").replace("}}", "}"))
        paths.append(str(tmp_path / f"{name}.yaml"))
    out = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, *paths], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 2 * len(BOMBS), out.stdout
    for first, message in zip(lines[::2], lines[1::2]):
        name, elapsed, cpu, peak, rss = first.split()
        elapsed, cpu, peak, rss = float(elapsed), float(cpu), float(peak), float(rss)
        print(f"{name}: {elapsed:.3f} s wall, {cpu:.3f} s CPU, tracemalloc peak {peak / 2**20:.1f} MiB, "
              f"max RSS growth {rss / 2**20:.1f} MiB")
        assert "refused" in message and "a recipe is limited to" in message, (name, message)
        assert cpu < 1.0 and elapsed < 5.0, name  # CPU time: the machine is shared, wall time waits for it
        assert peak < 32 * 2**20 and rss < 128 * 2**20, name


def test_a_million_key_recipe_is_refused_by_size_before_parsing(tmp_path, capsys):
    big = tmp_path / "million.yaml"
    with big.open("w") as f:
        for i in range(1_000_000):
            f.write(f"k{i}: {i}\n")
    start = time.perf_counter()
    code = cli_main(["recipes", "validate", str(big)])
    assert time.perf_counter() - start < 1.0
    err = capsys.readouterr().err
    assert code == 1 and "above the limit of 1048576 bytes" in err, err


# ------------------------------------------------------------------ the CLI, as a user runs it


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qlightning.cli", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, **(env or {})})


@pytest.mark.slow  # three `qlightning train` subprocesses: about 30 s on 2 cores
def test_train_refuses_hostile_and_bad_input_with_one_message(files, tmp_path):
    walk = tmp_path / "walk.yaml"
    walk.write_text(_fill(TARGETS[0][1], files))
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB_LAUGHS)
    for args, fragment in (
        ([f"recipe={walk}"], "is a module reached as an attribute"),
        ([f"recipe={bomb}"], "once aliases are expanded"),
        (["trainer.precision=fp7", "trainer.strategy=nosuch", f"ckpt_path={files['truncated']}"], "trainer.strategy='nosuch'"),
    ):
        out = _cli("train", *args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-3000:]
        assert fragment in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert not files["marker"].exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_an_internal_error_is_one_line_unless_debugging(tmp_path, monkeypatch):
    import qlightning.cli.recipes as recipes_cli

    def boom(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(recipes_cli, "validate", boom)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("QLIGHTNING_DEBUG", raising=False)
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert cli_main(["recipes", "validate", "digits_fast"]) == 1
    assert "internal error: RuntimeError: an internal bug" in err.getvalue() and "--debug" in err.getvalue()
    with pytest.raises(RuntimeError, match="an internal bug"):
        cli_main(["--debug", "recipes", "validate", "digits_fast"])
    monkeypatch.delenv("QLIGHTNING_DEBUG", raising=False)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(RuntimeError):
        cli_main(["recipes", "validate", "digits_fast"])


def test_shipped_recipes_still_validate():
    from qlightning.cli.recipes import validate

    for name in ("digits_fast", "digits_ptq", "lstm_dynamic", "lstm_static", "digits_w4a8_qat"):
        assert validate(name) == [], name


def test_a_checkpoint_written_by_training_passes_the_check(tmp_path):
    """Observer and fake-quant buffers change shape when they first observe: not a foreign model."""
    import lightning.pytorch as pl

    from qlightning.examples import DigitsDataModule

    overrides = ["quant.schedule.auto=true", "quant.convert_on_fit_end=false"]  # 3 steps: a derived schedule
    callback = build_callback(compose_config(overrides))
    trainer = pl.Trainer(max_steps=3, callbacks=[callback], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, accelerator="cpu")
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule())
    trainer.save_checkpoint(tmp_path / "real.ckpt")
    problems, _, _ = validate_config(compose_config([*overrides, f"ckpt_path={tmp_path / 'real.ckpt'}"]))
    assert problems == []
    other, _, _ = validate_config(compose_config([*overrides, "model.channels=[8,16,32]", f"ckpt_path={tmp_path / 'real.ckpt'}"]))
    assert any("saved from another model" in p and "shape(s) differ" in p for p in other), other
