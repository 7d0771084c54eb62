"""inductor's x86 int8 passes, which rewrite q/dq + conv / linear into oneDNN int8 kernels.

Up to torch 2.13 inductor registers them itself (``torch/_inductor/fx_passes/mkldnn_fusion.py``); from
torch 2.14 they live in torchao, which registers them when ``x86_inductor_quantizer`` is imported. The
PT2E engine imports it, so a process that had prepared a PT2E model compiled int8 kernels and one that had
used only the FX engine compiled the same q/dq graph into float convolutions with the rounding
simulated around them: ``lowering=inductor`` on an FX model ran at float speed (resnet18 at batch 32,
torch 2.14.1: 1.02x float against 2.79x with the passes).
"""

from __future__ import annotations

from typing import Optional

import torch

# the first torch whose inductor no longer registers the x86 int8 passes itself
PASSES_MOVED_TO_TORCHAO = (2, 14)


def x86_int8_passes() -> Optional[str]:
    """Make sure inductor lowers q/dq graphs to int8 kernels on x86: ``None`` when it will, else why not.

    Imports torchao's ``x86_inductor_quantizer`` (once per process; it registers the passes and sets
    ``torch._inductor.config.pre_grad_custom_pass`` to its quant lift-up pass, as a PT2E run does).
    """
    from qlightning.engines.pt2e.engine import _quiet_torchao_import

    try:
        with _quiet_torchao_import():
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401  registers on import
    except ImportError as exc:
        if torch.__version__ < PASSES_MOVED_TO_TORCHAO:  # a TorchVersion: compares with tuples
            return None  # inductor's own passes
        return (f"torch {torch.__version__}'s inductor lowers int8 q/dq graphs to int8 kernels only with torchao's "
                f"x86 passes, and torchao could not be imported ({exc}); without them the graph would run as float "
                "convolutions. Install torchao (pip install torchao) or use another lowering")
    return None
