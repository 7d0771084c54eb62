"""``ckpt_path`` checked before training: local, plain data, and saved by a run of this very config.

Lightning loads a remote ``ckpt_path`` (``http://``, ``s3://``, ...) with ``weights_only=False``,
which unpickles whatever the server sends, and reports a missing, truncated or foreign checkpoint
with a traceback in the middle of ``fit``. Here, before anything trains:

* a URL is refused unless ``allow_remote_ckpt=true`` was given on the command line (a recipe
  cannot set it); then it is downloaded once to a local file and checked like one, and
  ``cfg.ckpt_path`` is pointed at that file, so Lightning only ever reads a local path;
* the file is read with ``torch.load(..., weights_only=True)``: only tensors and plain
  containers, never code (qlightning's checkpoints are plain data);
* its quantization state (backend, engine, quantized submodules) and its ``state_dict`` keys and
  shapes are compared with the model this config builds (prepared the way training prepares it).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import DictConfig

# Lightning's own ckpt_path shortcuts: they name files only Lightning finds, after training started
# (and "registry" downloads); qlightning wants the path of the file.
SHORTCUTS = ("last", "best", "hpc", "registry")
MAX_DOWNLOAD_BYTES = 8 << 30
WEIGHT_NAMES = ("weight", "bias", "running_mean", "running_var", "weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")


def is_remote(path: str) -> bool:
    """A URL with a protocol (``http://``, ``s3://``, ``file://``, ...), which fsspec would fetch.

    Args:
        path: the ``ckpt_path`` as given; ``registry:`` and ``hf:`` prefixes count as remote too.
    """
    return "://" in path or path.startswith(("registry:", "hf:"))


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[0].split()) or type(exc).__name__
    return text[:300]


def download(url: str, key: str) -> tuple[Optional[Path], list[str]]:
    """Fetch ``url`` into a fresh temporary file (bytes only; nothing is unpickled here).

    Args:
        url: what fsspec fetches; more than ``MAX_DOWNLOAD_BYTES`` is refused.
        key: the config key, for messages.

    Returns:
        ``(local file, [])``, or ``(None, [message])`` when the download failed or was refused.
    """
    try:
        import fsspec

        directory = Path(tempfile.mkdtemp(prefix="qlightning-ckpt-"))
        local = directory / (Path(url.split("?", 1)[0]).name or "remote.ckpt")
        with fsspec.open(url, "rb") as src, open(local, "wb") as dst:
            copied = 0
            while chunk := src.read(1 << 20):
                copied += len(chunk)
                if copied > MAX_DOWNLOAD_BYTES:
                    shutil.rmtree(directory, ignore_errors=True)
                    return None, [f"{key}={url!r}: larger than {MAX_DOWNLOAD_BYTES} bytes; refused"]
                dst.write(chunk)
    except Exception as exc:
        return None, [f"{key}={url!r}: could not download: {type(exc).__name__}: {_first_line(exc)}"]
    return local, []


def load_plain(path: Path, key: str) -> tuple[Optional[dict], list[str]]:
    """The checkpoint dict read with ``weights_only=True``, or the problem in one message.

    Args:
        path: the checkpoint file (read on the CPU).
        key: the config key, for messages.

    Returns:
        ``(checkpoint, [])``, or ``(None, [message])`` for a missing, unreadable, non-plain or
        non-Lightning (no ``state_dict``) file.
    """
    import pickle

    import torch

    shown = f"{key}={str(path)!r}"
    if not path.exists():
        return None, [f"{shown}: no such file"]
    if not path.is_file():
        return None, [f"{shown}: not a file"]
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc):
            return None, [f"{shown}: holds objects other than tensors and plain data, which only unpickling code "
                          "could rebuild; refused (qlightning checkpoints are plain data)"]
        return None, [f"{shown}: not a PyTorch checkpoint ({_first_line(exc)})"]
    except Exception as exc:  # truncated zip, not a torch file, permissions, ...
        return None, [f"{shown}: not a readable PyTorch checkpoint (truncated or another kind of file): "
                      f"{type(exc).__name__}: {_first_line(exc)}"]
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        return None, [f"{shown}: not a Lightning checkpoint (no 'state_dict'; got {type(checkpoint).__name__})"]
    return checkpoint, []


def quant_state(checkpoint: dict) -> tuple[Optional[str], dict]:
    """``(callback name, state)`` of the qlightning callback saved in a Lightning checkpoint.

    Args:
        checkpoint: the loaded checkpoint dict (its ``callbacks`` entry is searched).

    Returns:
        ``("QuantizationAwareTraining" or "PostTrainingQuantization", state)``, or ``(None, {})`` if neither is saved.
    """
    for name, value in (checkpoint.get("callbacks") or {}).items():
        for cls in ("QuantizationAwareTraining", "PostTrainingQuantization"):
            if str(name).startswith(cls) and isinstance(value, dict):
                return cls, value
    return None, {}


def _diff_keys(expected: dict, found: dict, shown: str) -> list[str]:
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    # only the weights' shapes: observer and fake-quant buffers (min_val, scale, ...) start empty or
    # per-tensor and take their shape when they first observe; torch.ao's loaders resize them
    shapes = [f"{k}: checkpoint {tuple(found[k].shape)}, model {tuple(expected[k].shape)}"
              for k in expected if k in found and hasattr(found[k], "shape") and hasattr(expected[k], "shape")
              and k.rsplit(".", 1)[-1] in WEIGHT_NAMES and tuple(found[k].shape) != tuple(expected[k].shape)]
    if not (missing or unexpected or shapes):
        return []
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of the model missing, e.g. {missing[:3]}")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) the model does not have, e.g. {unexpected[:3]}")
    if shapes:
        parts.append(f"{len(shapes)} shape(s) differ, e.g. {shapes[:3]}")
    return [f"{shown}: saved from another model than this config builds: " + "; ".join(parts)]


def check_checkpoint(cfg: DictConfig, model: Optional[Any], make_callback: Callable[[], Any], key: str = "ckpt_path") -> list[str]:
    """Problems of ``cfg.ckpt_path`` for resuming ``model`` (built from ``cfg``, not prepared).

    Args:
        cfg: the composed config; a remote ``ckpt_path`` is replaced by the downloaded file.
        model: the LightningModule the config builds (left untouched: a copy is prepared); ``None``
            checks the path and the file only.
        make_callback: builds a fresh quantization callback of the config (to prepare the copy).
        key: the config key, for messages.
    """
    value = cfg.get("ckpt_path")
    if value is None:
        return []
    value = str(value)
    if value in SHORTCUTS:
        return [f"{key}={value!r}: give the path of a checkpoint file (e.g. outputs/<date>/<time>/checkpoints/last.ckpt); "
                "Lightning's shortcuts are not checked before training"]
    if is_remote(value):
        if not cfg.get("allow_remote_ckpt", False):
            return [f"{key}={value!r}: a remote checkpoint is refused; download it yourself, or give "
                    "allow_remote_ckpt=true on the command line (a recipe cannot) to fetch it and check it as plain data"]
        local, problems = download(value, key)
        if local is None:
            return problems
        cfg.ckpt_path = str(local)  # Lightning reads the checked local copy, never the URL
        path = local
    else:
        path = Path(os.path.expanduser(value))
    checkpoint, problems = load_plain(path, key)
    if checkpoint is None:
        return problems
    shown = f"{key}={str(path)!r}"
    method = str(getattr(cfg.quant.method, "value", cfg.quant.method))
    name, state = quant_state(checkpoint)
    expected_cls = "PostTrainingQuantization" if method == "ptq" else "QuantizationAwareTraining"
    if name != expected_cls:
        what = f"a {name} run" if name else "a run without qlightning's callback"
        return [f"{shown}: saved by {what}; this config (quant.method={method}) resumes {expected_cls} checkpoints only"]
    if model is None:  # other problems stopped the build: the file itself is checked, not its fit to the model
        return []
    errors = []
    for field in ("backend", "engine"):
        saved, wanted = state.get(field), cfg.quant.get(field)
        wanted = getattr(wanted, "value", wanted)
        if saved is not None and saved != wanted:
            errors.append(f"{shown}: trained with quant.{field}={saved!r}, this config has quant.{field}={wanted!r}")
    if errors:
        return errors
    if method == "ptq":  # trained in float: quantized only at fit end
        return _diff_keys(model.state_dict(), checkpoint["state_dict"], shown)
    try:
        callback = make_callback()
        prepared = copy.deepcopy(model)
        callback.prepare(prepared)
    except Exception:
        # preparation needs a batch this check does not load: compare what lies outside the quantized modules
        targets = [str(t) for t in state.get("modules") or []]
        outside = lambda sd: {k: v for k, v in sd.items() if not any(k.startswith(t + ".") for t in targets)}  # noqa: E731
        return _diff_keys(outside(model.state_dict()), outside(checkpoint["state_dict"]), shown)
    saved_modules = state.get("modules")
    if saved_modules is not None and list(saved_modules) != list(callback.targets):
        return [f"{shown}: trained with quantized modules {list(saved_modules)}, this config quantizes {list(callback.targets)}"]
    return _diff_keys(prepared.state_dict(), checkpoint["state_dict"], shown)
