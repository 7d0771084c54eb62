"""An LSTM sequence classifier on digits rows (each 8x8 image read as 8 rows of 8 pixels).

``nn.LSTM`` is a leaf for FX (it traces as one call), but FX has no static int8 pattern for it.
Two ways to quantize it through the callback:

* static (QAT or PTQ): torch.ao's quantizable LSTM as a custom module pair (route 2.b of the FX
  guide): ``torch.nn.LSTM -> torch.ao.nn.quantizable.LSTM`` at prepare (observed, built from
  LSTM cells of Linears and FloatFunctionals with fake-quants) and
  ``torch.ao.nn.quantizable.LSTM -> torch.ao.nn.quantized.LSTM`` at convert: :data:`LSTM_STATIC`.
  FX requires the LSTM to be called as ``lstm(x, (h0, c0))``: an LSTM called without its hidden
  state fails at convert with "Expected LSTM custom module inputs to be (input, (hidden0, hidden1))".
* dynamic: the ``dynamic`` qconfig for ``torch.nn.LSTM`` (int8 weights, activations quantized per
  call, float in and out): :data:`LSTM_DYNAMIC`.

Example::

    qat = QuantizationAwareTraining(modules=["net"], fake_quant_start={"epoch": 1}, **LSTM_STATIC)
    Trainer(max_epochs=4, callbacks=[qat]).fit(LSTMClassifier(), datamodule=DigitsDataModule(as_sequence=True))
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qlightning.examples.digits import ClassifierModule


class LSTMNet(nn.Module):
    """Rows -> ``nn.LSTM`` (batch first) -> Linear head on the last hidden state."""

    def __init__(self, hidden_size: int = 64, num_layers: int = 1, num_classes: int = 10) -> None:
        super().__init__()
        self.hidden_size, self.num_layers = hidden_size, num_layers
        self.lstm = nn.LSTM(8, hidden_size, num_layers=num_layers, batch_first=True)
        self.head = nn.Linear(hidden_size, num_classes)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        # the hidden state is passed explicitly: FX's static LSTM custom module needs (input, (h0, c0))
        h0 = rows.new_zeros(self.num_layers, rows.size(0), self.hidden_size)
        out, _ = self.lstm(rows, (h0, h0))
        return self.head(out[:, -1])


class LSTMClassifier(ClassifierModule):
    """:class:`LSTMNet` as ``self.net`` for ``DigitsDataModule(as_sequence=True)`` batches ``(N, 8, 8)``."""

    def __init__(self, hidden_size: int = 64, num_layers: int = 1, lr: float = 1e-2, weight_decay: float = 0.0) -> None:
        super().__init__(LSTMNet(hidden_size, num_layers), lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(1, 8, 8)


# QuantizationAwareTraining arguments (plain data, the same as the recipes lstm_static / lstm_dynamic)
LSTM_STATIC: dict[str, Any] = dict(
    prepare_custom_config={"float_to_observed": {"static": {"torch.nn.LSTM": "torch.ao.nn.quantizable.LSTM"}}},
    convert_custom_config={"observed_to_quantized": {"static": {"torch.ao.nn.quantizable.LSTM": "torch.ao.nn.quantized.LSTM"}}},
)
LSTM_DYNAMIC: dict[str, Any] = dict(
    qconfig_mapping={"global": "default", "object_type": [{"type": "torch.nn.LSTM", "qconfig": "dynamic"}]},
)
