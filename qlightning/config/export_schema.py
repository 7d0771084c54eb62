"""Config of exports and the parity gate (issue 7). Fields are filled in by that work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class ExportConf:
    """Which artifacts to write at fit end."""

    formats: List[str] = field(default_factory=list)


@dataclass
class ParityConf:
    """Thresholds comparing float, fake-quant, int8 and each exported artifact."""

    enabled: bool = False
