"""What `qlightning train` prints and logs: Lightning's messages through Hydra's handlers (console and
``train.log``), warnings into the same log, Lightning's advertising tips off, and known upstream noise
filtered with the upstream issue named."""

from __future__ import annotations

import logging
import os
import sys
import warnings

# (message regex, category, where it comes from and why it is not ours to fix)
UPSTREAM_NOISE: tuple[tuple[str, type[Warning], str], ...] = (
    (r".*isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     "lightning/pytorch/utilities/_pytree.py on torch >= 2.10: Lightning-AI/pytorch-lightning#21326"),
    (r".*Please use quant_min and quant_max to specify the range for observers", UserWarning,
     "torch.ao's own get_default_qat_qconfig('x86'/'fbgemm') passes reduce_range=True (torch/ao/quantization/observer.py)"),
    (r".*To copy construct from a tensor, it is recommended to use sourceTensor", UserWarning,
     "torch/_inductor/mkldnn_lowerings.py calls torch.tensor(w_zp_tensor) on a tensor (torch 2.13) when compiling int8 linears"),
    (r".*`torch\.jit\.\w+` is deprecated", FutureWarning,
     "torch >= 2.14 deprecates TorchScript; the torchscript export format (int8_NAME.pt) and torch.onnx's "
     "TorchScript-based exporter still use it, and the report says which format is which"),
    (r".*does not have many workers which may be a bottleneck", UserWarning,
     "Lightning's advice for the in-memory digits/MiniLM loaders, which have nothing to load in parallel"),
)
LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
TIP_PREFIX = "\N{ELECTRIC LIGHT BULB} Tip:"


class _NoTips(logging.Filter):
    """Drops Lightning's "Tip: try installing litlogger/litmodels" lines (Lightning 2.6 prints them every fit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(TIP_PREFIX)


def filter_upstream_noise() -> None:
    """Process-wide filters for :data:`UPSTREAM_NOISE` (the CLI owns its process; a library user's is theirs)."""
    for pattern, category, _ in UPSTREAM_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=category)


def route_logging() -> None:
    """After Hydra configured the root logger: Lightning's loggers go through its handlers, warnings too.

    Lightning gives ``lightning.pytorch``/``lightning.fabric`` their own stream handler and stops
    propagation when imported before logging is configured (qlightning imports it before Hydra runs),
    so nothing it says (qlightning's ``[qlightning]`` lines included) reached ``train.log``.
    """
    root = logging.getLogger()
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
    for handler in root.handlers:
        if not any(isinstance(f, _NoTips) for f in handler.filters):
            handler.addFilter(_NoTips())
    # torch's structured trace log (TORCH_TRACE, tlparse) is always at DEBUG: kept out of train.log, where a
    # compiled run (engine_options.compile) would write every dynamo frame's trace into it
    logging.getLogger("torch.__trace").propagate = False
    logging.captureWarnings(True)
    filter_upstream_noise()


def debugging() -> bool:
    """Whether an unexpected error should show its traceback (``--debug`` or ``HYDRA_FULL_ERROR=1``)."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get("QLIGHTNING_DEBUG") == "1"


def internal_error(exc: BaseException, prog: str = "qlightning") -> int:
    """One line for an unexpected exception (no traceback unless debugging); exit status 1.

    Args:
        exc: the exception; re-raised when :func:`debugging`, else printed to stderr (first 500 characters).
        prog: the program name the line starts with.
    """
    if debugging():
        raise exc
    text = " ".join(str(exc).split())[:500]
    print(f"{prog}: internal error: {type(exc).__name__}: {text}\n(rerun with --debug or HYDRA_FULL_ERROR=1 for the traceback, "
          "and report it if the input was valid)", file=sys.stderr)
    return 1
