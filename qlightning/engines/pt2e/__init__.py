"""The torchao PT2E engine: the only package that imports ``torchao``."""

from qlightning.engines.pt2e.engine import Pt2eEngine

__all__ = ["Pt2eEngine"]
