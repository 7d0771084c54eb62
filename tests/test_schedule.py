import pytest

from qlightning import ConfigError, Milestone, Phase, Schedule
from qlightning.core.schedule import AutoSchedule


def test_phase_is_a_function_of_step_and_epoch():
    s = Schedule.from_config({"epoch": 2}, {"step": 100}, {"epoch": 4})
    assert s.phase(0, 0) == Phase(fake_quant=False, observe=True, bn_frozen=False)
    assert s.phase(40, 2) == Phase(fake_quant=True, observe=True, bn_frozen=False)
    assert s.phase(100, 3) == Phase(fake_quant=True, observe=False, bn_frozen=False)
    assert s.phase(150, 4) == Phase(fake_quant=True, observe=False, bn_frozen=True)
    # the same progress always gives the same phase, whatever came before (resume)
    assert s.phase(40, 2) == s.phase(40, 2)


def test_defaults_mean_fake_quant_from_start_and_nothing_frozen():
    assert Schedule().phase(10**6, 1000) == Phase(fake_quant=True, observe=True, bn_frozen=False)


def test_all_schedule_errors_are_reported_together():
    with pytest.raises(ConfigError) as err:
        Schedule.from_config({"epoch": 3}, {"epoch": 1}, {"step": -5})
    text = str(err.value)
    assert "observer_freeze (epoch 1) comes before schedule.fake_quant_start (epoch 3)" in text
    assert "schedule.bn_freeze.step=-5: must be >= 0" in text
    assert len(err.value.problems) == 2


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"epoch": 1, "step": 3}, "either 'epoch' (1) or 'step' (3), not both"),
        ({"epochs": 1}, "unknown field(s) ['epochs']"),
        ({"step": 1.5}, "must be an integer"),
        ("soon", "expected a milestone"),
    ],
)
def test_bad_milestones_name_the_key(value, fragment):
    with pytest.raises(ConfigError, match="schedule.fake_quant_start") as err:
        Schedule.from_config(value)
    assert fragment in str(err.value)


def test_milestone_str():
    assert str(Milestone(step=5)) == "step 5" and str(Milestone(epoch=2)) == "epoch 2"


def test_memoryless_weight_observers_rest_only_in_float_steps_a_later_observing_step_overwrites():
    """The float warm-up's weight observation is skipped only where an observing fake-quant step is sure to come
    before a fake-quant step reads the weights' scales: no freeze, or a freeze strictly after the start in the
    same unit."""
    auto = AutoSchedule().resolve(100)  # fake-quant from step 50, observers frozen from 85
    assert auto.phase(0, 0).rest_memoryless_weights and auto.phase(49, 0).rest_memoryless_weights
    assert not auto.phase(50, 0).rest_memoryless_weights  # the first fake-quant step observes every weight
    assert not auto.phase(90, 0).rest_memoryless_weights
    assert Schedule(Milestone(epoch=2)).phase(0, 0).rest_memoryless_weights  # never frozen
    assert Schedule(Milestone(epoch=2), Milestone(epoch=3)).phase(0, 0).rest_memoryless_weights
    # frozen at the start: the scales the fake-quant steps use are the warm-up's, so the weights keep observing
    assert not Schedule(Milestone(step=50), Milestone(step=50)).phase(10, 0).rest_memoryless_weights
    # a step and an epoch cannot be ordered before the run: observe, to be safe
    assert not Schedule(Milestone(epoch=2), Milestone(step=500)).phase(0, 0).rest_memoryless_weights
    assert not Schedule(Milestone(epoch=2), Milestone(epoch=5)).phase(0, 6).rest_memoryless_weights  # frozen
    assert Phase.FLAGS == ("fake_quant", "observe", "bn_frozen")
