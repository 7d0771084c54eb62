"""After fit: exports, parity gate and the extended report (owned by the export work, issue 7)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def finalize_run(callback: Any, model: Any, datamodule: Any, cfg: Any, run_dir: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Write exported artifacts and check parity; returns keys to merge into the report.

    Called by :func:`qlightning.app.train` on rank zero after the int8 model and the basic report exist.
    """
    return {}
