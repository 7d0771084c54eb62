"""Image classifiers from torchvision and timm (random init) as LightningModules, and digits as RGB images.

The family recipes (``resnet_qat``, ``mobilenet_qat``, ``vit_qat``) build :class:`ImageClassifier` on
:class:`DigitsImageDataModule` so they run out of the box on a fresh machine; pointed at a data module of
yours (``data._target_=mypkg.MyDataModule model.num_classes=N trusted_modules=[mypkg]``) they train the
same architecture on your images. ``arch`` is a name from :data:`ARCHITECTURES`, never a code path: a
recipe stays data.

torchvision does not install beside the CPU build of torch 2.13.0 (README "Choosing your torch"); the
architectures say which package they need and :class:`ImageClassifier` names it when it is missing.

Example::

    from lightning.pytorch import Trainer
    from qlightning import QuantizationAwareTraining
    from qlightning.examples.vision import DigitsImageDataModule, ImageClassifier

    model = ImageClassifier(arch="resnet18", num_classes=10)
    trainer = Trainer(max_epochs=5, callbacks=[QuantizationAwareTraining(modules=["net"])])
    trainer.fit(model, datamodule=DigitsImageDataModule())
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from qlightning.examples.digits import ClassifierModule, DigitsDataModule


def _torchvision(name: str) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, image_size: int) -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)

    return build


def _torchvision_vit(num_classes: int, image_size: int) -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    # the zoo's small ViT: 16 patches of a 32x32 image, 2 layers of width 64 (learns digits in ~200 steps)
    return VisionTransformer(image_size=image_size, patch_size=image_size // 4, num_layers=2, num_heads=2,
                             hidden_dim=64, mlp_dim=128, num_classes=num_classes)


def _timm(name: str, **kwargs: Any) -> Callable[[int, int], nn.Module]:
    def build(num_classes: int, image_size: int) -> nn.Module:
        import timm

        extra = {"img_size": image_size, **kwargs} if "vit" in name else kwargs
        return timm.create_model(name, pretrained=False, num_classes=num_classes, **extra)

    return build


@dataclass(frozen=True)
class Architecture:
    """A model :class:`ImageClassifier` can build: the package it needs and how to build it."""

    package: str  # torchvision | timm
    build: Callable[[int, int], nn.Module]  # (num_classes, image_size) -> module


#: The architectures a recipe may name (``model.arch``): the model zoo's (``tests/zoo``), each measured there
#: through both engines (README "Model zoo").
ARCHITECTURES: dict[str, Architecture] = {
    "resnet18": Architecture("torchvision", _torchvision("resnet18")),
    "resnet50": Architecture("torchvision", _torchvision("resnet50")),
    "mobilenet_v2": Architecture("torchvision", _torchvision("mobilenet_v2")),
    "mobilenet_v3_small": Architecture("torchvision", _torchvision("mobilenet_v3_small")),
    "shufflenet_v2_x0_5": Architecture("torchvision", _torchvision("shufflenet_v2_x0_5")),
    "efficientnet_b0": Architecture("torchvision", _torchvision("efficientnet_b0")),
    "regnet_x_400mf": Architecture("torchvision", _torchvision("regnet_x_400mf")),
    "vit_small_tv": Architecture("torchvision", _torchvision_vit),
    "timm_vit_tiny": Architecture("timm", _timm("vit_tiny_patch16_224", patch_size=8, depth=4)),
    "timm_convnext_atto": Architecture("timm", _timm("convnext_atto")),
}


def missing_package(arch: str) -> Optional[str]:
    """The package ``arch`` needs that is not installed, or ``None``.

    Args:
        arch: a key of :data:`ARCHITECTURES`.
    """
    package = ARCHITECTURES[arch].package
    return None if importlib.util.find_spec(package) is not None else package


class ImageClassifier(ClassifierModule):
    """A torchvision / timm architecture (random init) as ``self.net``, trained with cross-entropy.

    Args:
        arch: the architecture, a key of :data:`ARCHITECTURES` (e.g. ``resnet18``, ``mobilenet_v2``,
            ``vit_small_tv``).
        num_classes: classes of the data (the width of the classifier head).
        image_size: side of the square input images (the example input that prepare traces with; ViTs are
            built for it).
        batch_norm_momentum: if set, every BatchNorm's momentum (torch's default 0.1; short fits from random
            init need more, since eval-mode statistics trail the weights); ``None`` keeps the model's own.
        lr: learning rate.
        weight_decay: weight decay.
        optimizer: ``adam``, ``adamw`` or ``sgd`` (momentum 0.9).
        scheduler: ``cosine`` (to zero over the run) or ``constant``.

    Raises:
        ValueError: ``arch`` is not a known architecture, or a number is out of range.
        ModuleNotFoundError: the package the architecture needs (torchvision / timm) is not installed.

    Example::

        model = ImageClassifier(arch="mobilenet_v2", num_classes=10, batch_norm_momentum=0.3)
        trainer = Trainer(max_epochs=5, callbacks=[QuantizationAwareTraining(modules=["net"])])
        trainer.fit(model, datamodule=DigitsImageDataModule())
    """

    def __init__(self, arch: str = "resnet18", num_classes: int = 10, image_size: int = 32,
                 batch_norm_momentum: Optional[float] = None, lr: float = 3e-3, weight_decay: float = 0.0,
                 optimizer: str = "adam", scheduler: str = "cosine") -> None:
        if arch not in ARCHITECTURES:
            raise ValueError(f"arch={arch!r}: valid choices: {sorted(ARCHITECTURES)}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r}: an integer >= 2")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 16:
            raise ValueError(f"image_size={image_size!r}: an integer >= 16 (pixels per side)")
        if batch_norm_momentum is not None and not 0.0 < float(batch_norm_momentum) <= 1.0:
            raise ValueError(f"batch_norm_momentum={batch_norm_momentum!r}: a number in (0, 1], or null for the model's own")
        missing = missing_package(arch)
        if missing is not None:
            raise ModuleNotFoundError(
                f"arch={arch!r} needs {missing}, which is not installed: pip install {missing} "
                "(torchvision needs a matching torch build; README 'Choosing your torch')")
        net = ARCHITECTURES[arch].build(num_classes, image_size)
        if batch_norm_momentum is not None:
            for module in net.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.momentum = float(batch_norm_momentum)
        super().__init__(net, lr=lr, weight_decay=weight_decay, num_classes=num_classes, optimizer=optimizer,
                         scheduler=scheduler)
        self.save_hyperparameters()
        self.example_input_array = torch.zeros(2, 3, image_size, image_size)


class DigitsImageDataModule(DigitsDataModule):
    """scikit-learn's digits as RGB images: upsampled (bilinear) to ``image_size``, normalized, three channels.

    The splits, the (seed, epoch) shuffling and the mid-epoch resume of :class:`DigitsDataModule`.

    Args:
        batch_size: Batch size of every loader.
        image_size: Side of the square images (8x8 digits upsampled).
        val_fraction: Share of the images held out for validation.
        test_fraction: Share of the images held out for the test set.
        seed: Seed of the split permutation and of the training loader's shuffling.
    """

    def __init__(self, batch_size: int = 32, image_size: int = 32, val_fraction: float = 0.15,
                 test_fraction: float = 0.15, seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, val_fraction=val_fraction, test_fraction=test_fraction, seed=seed)
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            raise ValueError(f"DigitsImageDataModule: image_size must be an integer >= 8, got {image_size!r}")
        self.image_size = image_size

    def setup(self, stage: Optional[str] = None) -> None:
        if self.splits:
            return
        super().setup(stage)
        for name, split in self.splits.items():
            images, labels = split.tensors
            images = nn.functional.interpolate(images, size=self.image_size, mode="bilinear", align_corners=False)
            # roughly zero mean, unit variance, as ImageNet-normalized inputs are
            split.tensors = (((images - 0.3) / 0.4).repeat(1, 3, 1, 1).contiguous(), labels)
