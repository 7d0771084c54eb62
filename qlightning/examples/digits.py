"""Digits (8x8 handwritten, 1797 images, shipped with scikit-learn) and a Conv-BN-ReLU CNN.

Real data that needs no download, small enough that a full float warm-up + QAT + convert run
takes well under a minute on two cores.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

from qlightning.callbacks.checkpoint import ResumableDataLoader


class EpochShuffleSampler(Sampler[int]):
    """A shuffling sampler whose order depends only on (seed, epoch).

    Lightning calls ``set_epoch`` before every epoch, so a run resumed from a checkpoint sees the
    same order in each epoch as the uninterrupted run (a plain ``shuffle=True`` loader re-created
    on resume would restart its generator). The training loader is a
    :class:`~qlightning.callbacks.checkpoint.ResumableDataLoader`, so a checkpoint taken in the middle of an
    epoch resumes with the batch that comes next in this order.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):  # type: ignore[override]
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's ``load_digits`` as 1x8x8 float images in [0, 1], split by a seeded permutation.

    Args:
        batch_size: Batch size of every loader.
        val_fraction: Share of the images held out for validation.
        test_fraction: Share of the images held out for the test set.
        seed: Seed of the split permutation and of the training loader's shuffling.
        as_sequence: Yield ``(N, 8, 8)`` row sequences instead of ``(N, 1, 8, 8)`` images.
    """

    def __init__(
        self,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        as_sequence: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1 or not 0 < test_fraction < 1 or val_fraction + test_fraction >= 1:
            raise ValueError(
                f"DigitsDataModule: val_fraction={val_fraction} and test_fraction={test_fraction} must be in (0, 1)"
                " and sum to less than 1"
            )
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule: batch_size must be a positive integer, got {batch_size}")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.as_sequence = as_sequence
        self.splits: dict[str, TensorDataset] = {}
        self._train_loader: ResumableDataLoader | None = None
        self._train_loader_state: dict[str, Any] | None = None  # from a checkpoint, for the next train loader

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.images / 16.0, dtype=torch.float32)
        images = images if self.as_sequence else images.unsqueeze(1)
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.from_numpy(np.random.default_rng(self.seed).permutation(len(labels)))
        n_test = int(round(len(labels) * self.test_fraction))
        n_val = int(round(len(labels) * self.val_fraction))
        parts = {
            "test": order[:n_test],
            "val": order[n_test : n_test + n_val],
            "train": order[n_test + n_val :],
        }
        self.splits = {name: TensorDataset(images[idx], labels[idx]) for name, idx in parts.items()}

    def _loader(self, split: str) -> DataLoader:
        self.setup()
        return DataLoader(self.splits[split], batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        """Shuffled in a (seed, epoch) order; resumes mid-epoch at the batch a checkpoint stopped before."""
        self.setup()
        data = self.splits["train"]
        resume_state, self._train_loader_state = self._train_loader_state, None
        sampler = EpochShuffleSampler(len(data), self.seed)
        self._train_loader = ResumableDataLoader(
            data, batch_size=self.batch_size, sampler=sampler, resume_state=resume_state
        )
        return self._train_loader

    def state_dict(self) -> dict[str, Any]:
        """The training loader's position (plain data), saved by Lightning in every checkpoint.

        Lightning also saves and restores a stateful training loader itself, but (Lightning 2.6,
        issue #20550) not when ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``
        (as :class:`ClassifierModule` does): the loader is then built before the checkpoint's loop
        state is restored and never gets its state. A data module's state is restored before that,
        so it is handed to the next training loader from here.
        """
        loader = getattr(self.trainer, "train_dataloader", None) if self.trainer is not None else None
        if not isinstance(loader, ResumableDataLoader):
            loader = self._train_loader  # the one Lightning iterates, unless it re-created it (DDP)
        if loader is None:
            return {} if self._train_loader_state is None else {"train_loader": dict(self._train_loader_state)}
        return {"train_loader": loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("train_loader")
        self._train_loader_state = dict(state) if state else None

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")


def conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class DigitsCNN(nn.Module):
    """Three Conv-BN-ReLU blocks, a max-pool, global average pooling and a linear classifier."""

    def __init__(self, channels: tuple[int, int, int] = (16, 32, 64), num_classes: int = 10) -> None:
        super().__init__()
        c1, c2, c3 = channels
        self.features = nn.Sequential(
            conv_bn_relu(1, c1), conv_bn_relu(c1, c2), nn.MaxPool2d(2), conv_bn_relu(c2, c3), nn.AdaptiveAvgPool2d(1)
        )
        self.classifier = nn.Linear(c3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class ResidualDWBlock(nn.Module):
    """Depthwise 3x3 conv-bn-relu, pointwise 1x1 conv-bn, add the input, relu."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.pw = nn.Sequential(nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.pw(self.dw(x)) + x)


class ResidualDepthwiseCNN(nn.Module):
    """A MobileNet-style residual net: conv-bn-relu stem, depthwise-separable residual blocks, pool, linear.

    Depthwise convolutions and residual adds are where per-tensor activation scales and BatchNorm
    folding hurt quantization most; one of the three nets the default QAT schedule was chosen on
    (notes/defaults.md).
    """

    def __init__(self, c: int = 32, blocks: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResidualDWBlock(c) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


class RowTransformer(nn.Module):
    """The 8 image rows as tokens: a Transformer encoder block that FX traces, for digits.

    Linear embedding plus learned positions, one pre-LayerNorm block (2-head self-attention written
    with ``nn.Linear`` / ``matmul`` / ``softmax``, ReLU MLP), mean pooling, a linear head. Shapes are
    constants, so ``torch.fx`` traces it.
    """

    def __init__(self, d: int = 48, heads: int = 2, mlp: int = 96, num_classes: int = 10) -> None:
        super().__init__()
        self.d, self.heads, self.dh = d, heads, d // heads
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(1, 8, d))
        nn.init.normal_(self.pos, std=0.02)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(mlp, d)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_classes)
        self.scale = self.dh**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x.reshape(-1, 8, 8)) + self.pos  # (N, 8 tokens, d)
        qkv = self.qkv(self.ln1(x)).reshape(-1, 8, 3, self.heads, self.dh).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (N, h, 8, dh)
        attn = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * self.scale, dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(-1, 8, self.d)
        x = x + self.proj(ctx)
        x = x + self.fc2(self.act(self.fc1(self.ln2(x))))
        return self.head(self.ln_f(x).mean(dim=1))


class ClassifierModule(pl.LightningModule):
    """A LightningModule around ``self.net`` with cross-entropy, Adam and torchmetrics accuracy.

    Every stage logs ``<stage>/loss`` and ``<stage>/accuracy``; the report reads the test ones.
    """

    def __init__(self, net: nn.Module, lr: float = 1e-2, weight_decay: float = 0.0, num_classes: int = 10,
                 optimizer: str = "adam", scheduler: str = "cosine") -> None:
        super().__init__()
        if optimizer not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer={optimizer!r}: valid choices: ['adam', 'adamw', 'sgd']")
        if scheduler not in ("cosine", "constant"):
            raise ValueError(f"scheduler={scheduler!r}: valid choices: ['cosine', 'constant']")
        self.net = net
        self.lr = lr
        self.weight_decay = weight_decay
        self.optimizer_name = optimizer
        self.scheduler_name = scheduler
        self.metrics = nn.ModuleDict(
            {
                stage: torchmetrics.Accuracy(task="multiclass", num_classes=num_classes)
                for stage in ("train_acc", "val_acc", "test_acc")
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        metric = self.metrics[f"{stage}_acc"]
        metric(logits, y)
        self.log(f"{stage}/loss", loss, prog_bar=stage != "test")
        self.log(f"{stage}/accuracy", metric, prog_bar=True)
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=self.weight_decay)
        else:
            kind = torch.optim.AdamW if self.optimizer_name == "adamw" else torch.optim.Adam
            optimizer = kind(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if self.scheduler_name == "constant":
            return optimizer
        # Cosine decay to zero: late QAT phases (observer and BatchNorm freeze) run at a small step size.
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DigitsClassifier(ClassifierModule):
    """The embedded default model: :class:`DigitsCNN` as ``self.net``.

    Example::

        model = DigitsClassifier()
        trainer = Trainer(max_epochs=6, callbacks=[QuantizationAwareTraining(modules=["net"])])
        trainer.fit(model, datamodule=DigitsDataModule())
    """

    def __init__(self, channels: tuple[int, int, int] = (16, 32, 64), lr: float = 1e-2, weight_decay: float = 0.0) -> None:
        super().__init__(DigitsCNN(tuple(channels)), lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(1, 1, 8, 8)
