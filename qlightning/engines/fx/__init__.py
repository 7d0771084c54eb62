"""The torch.ao FX graph mode engine: the only package that imports ``torch.ao.quantization``."""

from qlightning.engines.fx.ao import load_torch_ao, quiet_torch_ao
from qlightning.engines.fx.engine import FxEngine

__all__ = ["FxEngine", "load_torch_ao", "quiet_torch_ao"]
