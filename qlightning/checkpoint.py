"""Rebuild a fake-quant or int8 model from a QAT checkpoint, without a Trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
import torch

from qlightning.callbacks.qat import QuantizationAwareTraining
from qlightning.errors import QLightningError


def qat_state(checkpoint: dict) -> dict:
    """The QuantizationAwareTraining state saved in a Lightning checkpoint."""
    for key, value in checkpoint.get("callbacks", {}).items():
        if key.startswith("QuantizationAwareTraining"):
            return value
    raise QLightningError("this checkpoint holds no QuantizationAwareTraining state (was it saved by a QAT run?)")


def restore(
    model: pl.LightningModule,
    checkpoint_path: Union[str, Path],
    convert: bool = True,
    callback: Optional[QuantizationAwareTraining] = None,
) -> pl.LightningModule:
    """Load a QAT checkpoint into a freshly built ``model`` (strict keys) and return it.

    The checkpoint is read with ``weights_only=True``. The quantized submodules, backend and engine
    come from the checkpoint; pass the ``callback`` you trained with when it had a custom qconfig
    mapping or custom configs (those are code, not data, and are not stored). ``convert=False``
    returns the fake-quant model (observers off), ready to fine-tune or inspect.

    Example::

        model = restore(DigitsClassifier(), "outputs/.../checkpoints/last.ckpt")
        model.net  # int8, lowered for the backend the run trained for
    """
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
    state = qat_state(checkpoint)
    if callback is None:
        callback = QuantizationAwareTraining(modules=state["modules"], backend=state["backend"], engine=state["engine"])
    callback.prepare(model)
    model.load_state_dict(checkpoint["state_dict"], strict=True)
    callback.load_state_dict(state)
    for name in callback.targets:
        callback.engine.set_observers(model.get_submodule(name), False)
    model.eval()
    if convert:
        callback.convert(model)
    return model
