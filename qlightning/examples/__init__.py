"""The embedded default job: scikit-learn's bundled digits and a small Conv-BN-ReLU CNN."""

from qlightning.examples.digits import DigitsClassifier, DigitsDataModule

__all__ = ["DigitsClassifier", "DigitsDataModule"]
