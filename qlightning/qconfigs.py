"""Compatibility alias: the qconfig helpers live in :mod:`qlightning.engines.fx.qconfigs` (torch.ao FX)."""

from qlightning.engines.fx.qconfigs import *  # noqa: F401,F403
from qlightning.engines.fx.qconfigs import __all__  # noqa: F401
