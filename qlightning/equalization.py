"""Compatibility alias: equalization lives in :mod:`qlightning.quantize.equalization`."""

from qlightning.quantize.equalization import *  # noqa: F401,F403
