"""Whether a run's QAT training forwards go through ``torch.compile`` (``engine_options.compile``).

``on`` compiles from the first step, ``off`` never; ``auto`` times a few eager training steps and compiles
when the time the compiled path would save over the run's remaining steps exceeds what compiling costs
(one compile per phase still to come: the schedule's phases are guarded state, so each recompiles once; the
first grows with the model's fake-quants).
Engine-neutral and Lightning-free: the callback feeds it step times and asks.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Optional

from qlightning.core.schedule import Schedule

#: fraction of an eager QAT step the compiled path saves, over a default schedule (half float warm-up, 35 %
#: observing, 15 % frozen): a low figure of ``python -m benchmarks compile`` on an AVX2 EPYC (stop 48: digits CNN
#: about 0.23, Transformer 0.15, ResNet-18-like 0.09; observing / frozen phases alone 0.08-0.30, where the Xeon of
#: stop 42 read 0.19-0.36), so that ``auto`` errs towards staying eager
EXPECTED_SAVING = 0.1
#: a run's first compile (forward and backward graphs, inductor on CPU, cold cache) takes about
#: ``COMPILE_BASE_SECONDS + COMPILE_SECONDS_PER_FAKE_QUANT * fake-quants``: fitted to ``python -m benchmarks
#: compile`` on a 2-vCPU AMD EPYC with AVX2, the batch dimension dynamic (stop 48: digits CNN, 10 fake-quants,
#: 83 s; ResNet-18-like, 52: 362 s; Transformer, 87: 568 s). The 2-core Xeon of stop 42 compiled in 0.52-0.57 of
#: that (15 s + 3.2 s per fake-quant); fitted to the slower CPU, ``auto`` errs towards staying eager there too.
COMPILE_BASE_SECONDS = 24.0
COMPILE_SECONDS_PER_FAKE_QUANT = 6.3
#: a later phase's compile over the first's (it reuses the first's kernels: 0.21-0.28 on the EPYC, 0.21-0.30 on
#: the Xeon)
LATER_COMPILE_FRACTION = 0.3
#: eager steps timed before ``auto`` decides (after the first step of the fit, which pays allocations)
TIMED_STEPS = 4


@dataclass(frozen=True)
class CompileChoice:
    """What was decided and from which figures (the report and the log show it)."""

    mode: str
    compiled: bool
    reason: str
    eager_step_ms: Optional[float] = None
    steps_left: Optional[int] = None
    compiles_expected: Optional[int] = None
    compile_seconds_expected: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set, as a plain dict (``None`` fields left out) for report.json."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def describe(self) -> str:
        """One log line: whether the compiled training path is on, the mode and the reason."""
        return f"compiled training path {'on' if self.compiled else 'off'} (engine_options.compile={self.mode}: {self.reason})"


def phases_left(schedule: Schedule, global_step: int, epoch: int) -> int:
    """The phase now and each milestone still ahead: how many compiles the rest of the run needs at most.

    Args:
        schedule: the run's QAT schedule; its ``fake_quant_start``, ``observer_freeze`` and ``bn_freeze``
            milestones are counted.
        global_step: the trainer's current global step.
        epoch: the trainer's current epoch.

    Returns:
        1 (the current phase) plus the number of set milestones not yet reached.
    """
    ahead = [m for m in (schedule.fake_quant_start, schedule.observer_freeze, schedule.bn_freeze)
             if m is not None and not m.reached(global_step, epoch)]
    return 1 + len(ahead)


def compile_seconds(fake_quants: int, compiles: int) -> float:
    """Seconds the run's compiles are expected to take: the first by the module's size, each later one a fraction.

    Args:
        fake_quants: fake-quant modules in the compiled targets (the compiled graphs grow with them).
        compiles: compiles the rest of the run needs (e.g. :func:`phases_left`); 0 costs nothing.

    Returns:
        ``first * (1 + LATER_COMPILE_FRACTION * (compiles - 1))``, ``first`` from the fit above.
    """
    if compiles <= 0:
        return 0.0
    first = COMPILE_BASE_SECONDS + COMPILE_SECONDS_PER_FAKE_QUANT * fake_quants
    return first * (1 + LATER_COMPILE_FRACTION * (compiles - 1))


class CompileDecider:
    """Collects eager step times and decides once, for ``mode`` ``auto`` (``on`` / ``off`` decide at once).

    Args:
        mode: ``auto``, ``on`` or ``off``.
        supported: whether the engine has a compiled path.
        processes: the run's world size (the compiled path is single-process for now).
    """

    def __init__(self, mode: str, supported: bool, processes: int = 1) -> None:
        self.mode = mode
        self.supported = supported
        self.processes = processes
        self.step_seconds: list[float] = []
        self.choice: Optional[CompileChoice] = None
        if mode == "off":
            self.choice = CompileChoice(mode, False, "off")
        elif not supported:
            self.choice = CompileChoice(mode, False, "this engine has no compiled path")
        elif processes > 1:
            self.choice = CompileChoice(mode, False, f"{processes} processes: the compiled path is single-process")
        elif mode == "on":
            self.choice = CompileChoice(mode, True, "on")

    @property
    def pending(self) -> bool:
        """Whether no choice has been made yet (``auto`` still timing steps)."""
        return self.choice is None

    def add_step(self, seconds: float) -> None:
        """Record the wall time of one eager training step.

        Args:
            seconds: the step's duration in seconds.
        """
        self.step_seconds.append(seconds)

    def ready(self) -> bool:
        """Whether no choice is made yet and more than ``TIMED_STEPS`` step times are in (the first is not counted)."""
        return self.pending and len(self.step_seconds) > TIMED_STEPS  # the first one is not counted

    def decide(self, steps_left: Optional[float], compiles: int, fake_quants: int) -> CompileChoice:
        """``auto``: compile when ``steps_left * eager step * EXPECTED_SAVING > compile_seconds(fake_quants, compiles)``.

        The eager step is the median of the recorded step times after the first. The choice is also stored
        in ``self.choice``.

        Args:
            steps_left: training steps still to run; ``None`` or infinity (unknown length) means no compile.
            compiles: compiles the rest of the run needs (e.g. :func:`phases_left`).
            fake_quants: fake-quant modules in the targets that would be compiled (:func:`compile_seconds`).

        Returns:
            The :class:`CompileChoice`, with the figures it was made from.
        """
        step = statistics.median(self.step_seconds[1:])
        if steps_left is None or steps_left == float("inf"):
            self.choice = CompileChoice(self.mode, False, "the fit has no known length", round(step * 1e3, 2))
            return self.choice
        saved, cost = steps_left * step * EXPECTED_SAVING, compile_seconds(fake_quants, compiles)
        compiled = saved > cost
        reason = (f"{int(steps_left)} steps left x {step * 1e3:.1f} ms eager: about {saved:.0f} s to save "
                  f"{'>' if compiled else '<='} about {cost:.0f} s for {compiles} compile(s) of {fake_quants} fake-quants")
        self.choice = CompileChoice(self.mode, compiled, reason, round(step * 1e3, 2), int(steps_left), compiles,
                                    round(cost, 1))
        return self.choice
