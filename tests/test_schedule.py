import pytest

from qlightning import ConfigError, Milestone, Phase, Schedule


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
