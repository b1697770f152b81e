"""Warm-up schedules: dense steps, DGC's sparsity ramp, settings in the state dict."""
import pytest
import torch

from gradcomp import FP16, ThreeBit, TopK, TwoBit
from gradcomp.schedule import DGC_DENSITIES, CodeSwitch, DenseWarmup, SparsityRamp, recommended


def density(compressor):
    return compressor.density


def test_dense_warmup_then_base():
    base = TopK(0.01)
    schedule = DenseWarmup(3)
    assert [schedule.compressor_at(s, base) for s in range(5)] == [None, None, None, base, base]


def test_ramp_stages_follow_dgc_and_stop_at_the_base_density():
    base = TopK(0.01)
    schedule = SparsityRamp(dense_steps=2, stage_steps=10)
    got = [schedule.compressor_at(s, base) for s in range(60)]
    assert got[:2] == [None, None]
    assert [density(c) for c in got[2:12]] == [0.25] * 10
    assert [density(c) for c in got[12:22]] == [0.0625] * 10
    assert [density(c) for c in got[22:32]] == [0.015625] * 10
    # 0.39% is sparser than the base's 1%: the ramp ends at the base itself.
    assert all(c is base for c in got[32:])
    assert schedule.ramp_end(base) == 32


def test_ramp_to_a_sparser_base_uses_every_stage():
    base = TopK(0.001)
    schedule = SparsityRamp(dense_steps=0, stage_steps=5)
    assert schedule.stages(base) == DGC_DENSITIES
    assert density(schedule.compressor_at(19, base)) == DGC_DENSITIES[3]
    assert schedule.compressor_at(20, base) is base


def test_payload_size_is_a_function_of_the_step_only():
    """Two ranks' schedules (separate objects) give equal payload layouts at every step."""
    base_a, base_b = TopK(0.01), TopK(0.01)
    a, b = SparsityRamp(stage_steps=7), SparsityRamp(stage_steps=7)
    for step in range(0, 60):
        ca, cb = a.compressor_at(step, base_a), b.compressor_at(step, base_b)
        assert (ca is None) == (cb is None)
        if ca is not None:
            assert ca.layout(10_000, torch.float32) == cb.layout(10_000, torch.float32)


def test_ramp_keeps_the_base_settings_and_does_not_mutate_it():
    base = TopK(0.01)
    base.extra_setting = "kept"
    stage = SparsityRamp(dense_steps=0).compressor_at(0, base)
    assert stage.extra_setting == "kept" and density(stage) == 0.25 and density(base) == 0.01
    # A new base object is honoured (no stale cached copy).
    other = TopK(0.02)
    assert SparsityRamp(dense_steps=0).compressor_at(0, other) is not stage


def test_non_topk_compressors_get_dense_steps_only():
    schedule = SparsityRamp(dense_steps=4, stage_steps=10)
    for base in (TwoBit(0.5), FP16()):
        assert schedule.compressor_at(3, base) is None
        assert schedule.compressor_at(4, base) is base


def test_recommended_defaults():
    assert isinstance(recommended(TopK(0.01)), SparsityRamp)
    assert recommended(TopK(0.01)).stage_steps == 100
    assert recommended(TwoBit(0.5)).dense_steps == 100
    assert recommended(TwoBit(0.5)).compressor_at(99, TwoBit(0.5)) is None


def test_state_dict_round_trip_and_mismatch_is_a_clear_error():
    schedule = SparsityRamp(dense_steps=5, stage_steps=20)
    state = schedule.state_dict()
    SparsityRamp(dense_steps=5, stage_steps=20).load_state_dict(state)
    # As it comes back from a checkpoint saved with json (lists, not tuples).
    SparsityRamp(dense_steps=5, stage_steps=20).load_state_dict({**state, "densities": list(state["densities"])})
    with pytest.raises(ValueError, match="stage_steps"):
        SparsityRamp(dense_steps=5, stage_steps=10).load_state_dict(state)
    with pytest.raises(ValueError, match="schedule"):
        DenseWarmup(5).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs",
    [{"dense_steps": -1}, {"stage_steps": 0}, {"densities": ()}, {"densities": (0.1, 0.2)}, {"densities": (1.5,)},
     {"dense_steps": 1.5}],
)
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SparsityRamp(**kwargs)


def test_bad_step_is_rejected():
    with pytest.raises(ValueError, match="step"):
        DenseWarmup(2).compressor_at(-1, TopK(0.01))


def test_code_switch_runs_the_base_then_the_later_code():
    base, later = ThreeBit(), TwoBit("chunk")
    schedule = CodeSwitch(2, 4, later)
    assert [schedule.compressor_at(s, base) for s in range(6)] == [None, None, base, base, later, later]
    assert schedule.settings() == {"kind": "code_switch", "dense_steps": 2, "switch_step": 4, "later": later.spec}
    CodeSwitch(2, 4, TwoBit("chunk")).load_state_dict(schedule.state_dict())
    with pytest.raises(ValueError, match="switch_step"):
        CodeSwitch(2, 5, later).load_state_dict(schedule.state_dict())
    with pytest.raises(ValueError, match="switch_step"):
        CodeSwitch(3, 2, later)  # a switch inside the dense start


def test_a_planned_schedule_sends_its_dense_steps_in_its_start_compressor_after_the_first_two():
    from gradcomp.schedule import PlannedSchedule

    base, start = TopK(0.01), FP16()
    planned = PlannedSchedule(DenseWarmup(5), 100, announce=False, start=start)
    assert [planned.compressor_at(s, base) for s in range(7)] == [None, None, start, start, start, base, base]
    assert planned.settings() == DenseWarmup(5).settings()  # a checkpoint holds the plan's own settings
    bare = PlannedSchedule(DenseWarmup(5), 100, announce=False)
    assert [bare.compressor_at(s, base) for s in range(6)] == [None] * 5 + [base]
