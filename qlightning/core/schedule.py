"""The QAT schedule: which quantization phase holds at a given (global step, epoch).

The phase is a pure function of training progress, so a run resumed from any checkpoint is in
exactly the phase the uninterrupted run was in at that point. Nothing here touches torch.ao.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from qlightning.errors import ConfigError


@dataclass(frozen=True)
class Milestone:
    """A point in training, given in optimizer steps *or* epochs (exactly one of them).

    ``Milestone(epoch=2)`` is reached when the third epoch starts; ``Milestone(step=150)`` when the
    150th optimizer step is about to run (global step 150, counting from 0).
    """

    epoch: Optional[int] = None
    step: Optional[int] = None

    def reached(self, global_step: int, epoch: int) -> bool:
        """Whether training at ``global_step`` in ``epoch`` is at or past this milestone.

        Args:
            global_step: the optimizer step about to run (counting from 0); compared with ``step`` if set.
            epoch: the current epoch (counting from 0); compared with ``epoch`` otherwise.
        """
        if self.step is not None:
            return global_step >= self.step
        return epoch >= self.epoch  # type: ignore[operator]

    def __str__(self) -> str:
        return f"step {self.step}" if self.step is not None else f"epoch {self.epoch}"


MilestoneLike = Union[Milestone, Mapping[str, Any], str, None]

#: a milestone left to the run: derived from its length (see :class:`AutoSchedule`)
AUTO = "auto"


def to_milestone(value: Any, key: str, errors: list[str]) -> Optional[Milestone]:
    """Read ``None``, a :class:`Milestone` or a mapping ``{"epoch": N}`` / ``{"step": N}``.

    Problems are appended to ``errors`` (naming ``key``) so every bad value is reported at once.

    Args:
        value: the milestone as given; ``"auto"``, unknown fields, both ``epoch`` and ``step``, a
            non-integer or a negative count are errors.
        key: the config key, for messages.
        errors: list the messages are appended to.

    Returns:
        The milestone, or ``None`` for "never" (``None``, or neither field set) and for an invalid value.
    """
    if value == AUTO:
        errors.append(f"{key}='auto': only the whole schedule can be derived from the run; give a milestone here")
        return None
    if value is None or isinstance(value, Milestone):
        fields = {} if value is None else {"epoch": value.epoch, "step": value.step}
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"epoch", "step"})
        if unknown:
            errors.append(f"{key}: unknown field(s) {unknown}; a milestone has 'epoch' or 'step'")
            return None
        fields = dict(value)
    else:
        errors.append(
            f"{key}={value!r}: expected a milestone such as {{epoch: 2}} or {{step: 100}}, or null for never"
        )
        return None
    epoch, step = fields.get("epoch"), fields.get("step")
    if epoch is None and step is None:
        return None
    if epoch is not None and step is not None:
        errors.append(
            f"{key}: give either 'epoch' ({epoch}) or 'step' ({step}), not both; set the other to null, "
            f"e.g. {{step: {step}, epoch: null}}"
        )
        return None
    unit, count = ("epoch", epoch) if epoch is not None else ("step", step)
    if isinstance(count, bool) or not isinstance(count, int):
        errors.append(f"{key}.{unit}={count!r}: must be an integer")
        return None
    if count < 0:
        errors.append(f"{key}.{unit}={count}: must be >= 0")
        return None
    return Milestone(epoch=epoch, step=step)


@dataclass(frozen=True)
class Phase:
    """What the quantization machinery does right now.

    Attributes:
        fake_quant: forward passes see quantized numerics (weights and activations).
        observe: observers update their statistics (and hence scales / zero points).
        bn_frozen: BatchNorm running statistics are frozen (fused QAT modules use them).
        rest_memoryless_weights: weight observers whose state is only their last observation (a moving
            average with ``averaging_constant=1``, the default mappings' conv-bn weights) skip this step.
            Set in a float step when the schedule guarantees a fake-quant step that observes before any
            fake-quant step that reads them: observing the weights in the float warm-up was work whose
            result the first fake-quant step overwrote (up to rounding).
    """

    fake_quant: bool
    observe: bool
    bn_frozen: bool
    rest_memoryless_weights: bool = field(default=False, compare=False)  # follows from the flags and the schedule

    #: the flags a run logs and reports (``rest_memoryless_weights`` follows from them and the schedule)
    FLAGS = ("fake_quant", "observe", "bn_frozen")

    def describe(self) -> str:
        """The phase in words: fake-quant on/off, observers on/frozen, BN stats frozen/updating."""
        return (
            f"fake-quant {'on' if self.fake_quant else 'off'}, observers {'on' if self.observe else 'frozen'}, "
            f"BN stats {'frozen' if self.bn_frozen else 'updating'}"
        )


@dataclass(frozen=True)
class Schedule:
    """Fake-quant start, observer freeze and BatchNorm freeze milestones.

    ``None`` means: fake-quant from the very first step, observers never frozen, BN never frozen.
    Observers run during the float warm-up (before fake-quant starts) so that the first fake-quant
    step already has calibrated scales; weight observers that keep only their last observation rest
    there when an observing fake-quant step comes first (:attr:`Phase.rest_memoryless_weights`).

    Example::

        Schedule(fake_quant_start=Milestone(epoch=2), observer_freeze=Milestone(epoch=5))
    """

    fake_quant_start: Optional[Milestone] = None
    observer_freeze: Optional[Milestone] = None
    bn_freeze: Optional[Milestone] = None

    @classmethod
    def from_config(
        cls,
        fake_quant_start: MilestoneLike = None,
        observer_freeze: MilestoneLike = None,
        bn_freeze: MilestoneLike = None,
        *,
        prefix: str = "schedule",
        errors: Optional[list[str]] = None,
    ) -> "Schedule":
        """Build a schedule from milestone-like values, collecting every problem before raising.

        Args:
            fake_quant_start: when fake-quant starts (see :func:`to_milestone`); ``None`` for the first step.
            observer_freeze: when observers freeze; ``None`` for never.
            bn_freeze: when BatchNorm statistics freeze; ``None`` for never.
            prefix: the config key the milestone names are prefixed with in messages.
            errors: list to append problems to instead of raising; if ``None``, problems raise
                :class:`~qlightning.errors.ConfigError`.
        """
        own_errors: list[str] = [] if errors is None else errors
        schedule = cls(
            to_milestone(fake_quant_start, f"{prefix}.fake_quant_start", own_errors),
            to_milestone(observer_freeze, f"{prefix}.observer_freeze", own_errors),
            to_milestone(bn_freeze, f"{prefix}.bn_freeze", own_errors),
        )
        schedule.check_order(own_errors, prefix)
        if errors is None and own_errors:
            raise ConfigError(own_errors)
        return schedule

    def check_order(self, errors: list[str], prefix: str = "schedule") -> None:
        """Observers must not freeze before fake-quant starts (their scales would never be trained on).

        Only milestones in the same unit (both steps or both epochs) are compared.

        Args:
            errors: list the message is appended to.
            prefix: the config key the milestone names are prefixed with in the message.
        """
        start, freeze = self.fake_quant_start, self.observer_freeze
        if start is None or freeze is None:
            return
        same_unit = (start.step is None) == (freeze.step is None)
        if same_unit and (freeze.step or freeze.epoch or 0) < (start.step or start.epoch or 0):
            errors.append(
                f"{prefix}.observer_freeze ({freeze}) comes before {prefix}.fake_quant_start ({start}): "
                "observers must keep running at least until fake-quant starts"
            )

    def phase(self, global_step: int, epoch: int) -> Phase:
        """The phase for the training step about to run at ``global_step`` in ``epoch``.

        Args:
            global_step: the optimizer step about to run (counting from 0).
            epoch: the current epoch (counting from 0).
        """

        def reached(milestone: Optional[Milestone], default: bool) -> bool:
            return default if milestone is None else milestone.reached(global_step, epoch)

        fake_quant = reached(self.fake_quant_start, True)
        observe = not reached(self.observer_freeze, False)
        return Phase(
            fake_quant=fake_quant,
            observe=observe,
            bn_frozen=reached(self.bn_freeze, False),
            rest_memoryless_weights=observe and not fake_quant and self.observes_after_fake_quant_start(),
        )

    def observes_after_fake_quant_start(self) -> bool:
        """Whether observers still run at the first fake-quant step: no freeze, or a freeze strictly after the
        start in the same unit (a start and a freeze in different units cannot be ordered before the run)."""
        start, freeze = self.fake_quant_start, self.observer_freeze
        if freeze is None:
            return True
        if start is None or (start.step is None) != (freeze.step is None):
            return False
        return (freeze.step if freeze.step is not None else freeze.epoch) > (start.step if start.step is not None else start.epoch)


@dataclass(frozen=True)
class AutoSchedule:
    """The default schedule, derived from the length of the run.

    Float for the first ``fake_quant_start`` share of the optimizer steps (observers calibrating
    meanwhile), then fake-quant; observers freeze from the ``observer_freeze`` share on, so the last
    stretch trains against the scales that ship. BatchNorm statistics are not frozen: in the study
    (notes/defaults.md; 470 runs over SGD/Adam/AdamW, learning rates 1e-3 to 1e-1, constant and cosine
    LR, from scratch and fine-tuning, a CNN, a residual depthwise net and a Transformer block, 2-3
    seeds) every schedule that froze BN together with the observers collapsed some constant-LR runs
    to chance (the same happens in float training with BN switched to eval mode), while freezing the
    observers alone is what makes int8 match fake-quant.

    Attributes:
        fake_quant_start: share of the total steps trained in float first.
        observer_freeze: share of the total steps after which observers freeze.
    """

    fake_quant_start: float = 0.5
    observer_freeze: float = 0.85

    def resolve(self, total_steps: int) -> Schedule:
        """Step milestones for a run of ``total_steps`` optimizer steps (BN never frozen).

        Args:
            total_steps: optimizer steps of the whole fit; the shares are rounded to steps, and the
                observer freeze comes at least one step after the fake-quant start.
        """
        start = int(round(self.fake_quant_start * total_steps))
        freeze = max(start + 1, int(round(self.observer_freeze * total_steps)))
        return Schedule(Milestone(step=start), Milestone(step=max(1, freeze)), None)

    def describe(self) -> str:
        """The derived schedule in words, with its shares as percentages."""
        return (f"auto: float for the first {self.fake_quant_start:.0%} of the steps, fake-quant after, "
                f"observers frozen from {self.observer_freeze:.0%}, BatchNorm statistics never frozen")


def _given_milestones(schedule: Schedule) -> list[tuple[str, "Milestone"]]:
    """``(name, milestone)`` of each milestone ``schedule`` sets, in the order a fit meets them."""
    keys = ("fake_quant_start", "observer_freeze", "bn_freeze")
    return [(key, getattr(schedule, key)) for key in keys if getattr(schedule, key) is not None]


def _never_reached(prefix: str, key: str, milestone: "Milestone", ends: str) -> str:
    unit = "step" if milestone.step is not None else "epoch"
    value = milestone.step if milestone.step is not None else milestone.epoch
    return (f"{prefix}{key}={{{unit}: {value}}}: the fit ends {ends}, so it is never reached and the model would be "
            f"converted without training against quantization; move it earlier, train longer, or leave the schedule "
            f"to the run (the default)")


def unreachable(schedule: Schedule, total_steps: Optional[float], steps_per_epoch: Optional[float],
                limits: str = "", prefix: str = "") -> list[str]:
    """Milestones a fit of ``total_steps`` optimizer steps (``steps_per_epoch`` a epoch) never reaches.

    Args:
        schedule: the milestones.
        total_steps: optimizer steps of the whole fit (``trainer.estimated_stepping_batches``).
        steps_per_epoch: optimizer steps of one epoch, to place epoch milestones.
        limits: the Trainer limits in words (``max_epochs=2``), for the message.
        prefix: prepended to each milestone's name.
    """
    if total_steps is None or total_steps == float("inf"):
        return []
    problems = []
    for key, milestone in _given_milestones(schedule):
        step = milestone.step if milestone.step is not None else (
            None if not steps_per_epoch else milestone.epoch * steps_per_epoch)
        if step is not None and step >= total_steps:
            problems.append(_never_reached(
                prefix, key, milestone, f"after {int(total_steps)} optimizer steps ({limits or 'the Trainer limits'})"))
    return problems


def beyond_trainer_limits(schedule: Schedule, max_epochs: Optional[int], max_steps: Optional[int],
                          prefix: str = "") -> list[str]:
    """Milestones past the Trainer's own ``max_epochs`` / ``max_steps``: known from the configuration alone, before a
    Trainer or a data loader exists (:func:`unreachable` finds the rest once the run's length is known).

    Args:
        schedule: the milestones.
        max_epochs: the Trainer's ``max_epochs`` (``None`` or negative: no limit).
        max_steps: the Trainer's ``max_steps`` (``None`` or negative: no limit).
        prefix: prepended to each milestone's name.
    """
    problems = []
    for key, milestone in _given_milestones(schedule):
        if milestone.step is not None and max_steps is not None and 0 <= max_steps <= milestone.step:
            problems.append(_never_reached(prefix, key, milestone, f"at max_steps={max_steps}"))
        elif milestone.epoch is not None and max_epochs is not None and 0 <= max_epochs <= milestone.epoch:
            problems.append(_never_reached(prefix, key, milestone, f"after max_epochs={max_epochs}"))
    return problems
