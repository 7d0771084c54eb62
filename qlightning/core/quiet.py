"""The one warning- and log-silencing context: what a library prints on every call, said once in the README."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Iterable, Iterator


@contextlib.contextmanager
def quiet(
    messages: Iterable[str] = (),
    loggers: Iterable[str] = (),
    level: int = logging.ERROR,
    all_warnings: bool = False,
    stdout: bool = False,
    stderr: bool = False,
) -> Iterator[None]:
    """Silence known noise for the duration of a call, restoring every filter and level afterwards.

    Args:
        messages: regular expressions of warning messages to ignore.
        loggers: names of loggers raised to ``level`` meanwhile.
        level: the level those loggers are set to.
        all_warnings: ignore every warning (for exporters that warn about their own internals).
        stdout: also swallow what is printed to standard output.
        stderr: also swallow what is printed to standard error.
    """
    named = [logging.getLogger(n) for n in loggers]
    levels = [lg.level for lg in named]
    for lg in named:
        lg.setLevel(level)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as stack:
            if all_warnings:
                warnings.simplefilter("ignore")
            for pattern in messages:
                warnings.filterwarnings("ignore", message=pattern)
            if stdout:
                stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            if stderr:
                stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
            yield
    finally:
        for lg, old in zip(named, levels):
            lg.setLevel(old)
