"""Loads of the optimizer stage validate everything before they assign anything (in-process)."""
import pytest
import torch

import gradcomp
from gradcomp.engine import Engine
from gradcomp.optim import FrozenVarianceAdam


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _stage_with_moments():
    """A FrozenVarianceAdam past its freeze that exchanged its first moments once."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, model.named_parameters(), freeze_step=1, exchange="momentum")
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()  # plain AdamW: the freeze comes after one step
    names = [n for n, _ in model.named_parameters()]
    numels = [p.numel() for _, p in model.named_parameters()]
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    stage.before_compress(names, numels, grad)
    stage.commit(names)
    return model, optimizer, stage


@pytest.mark.parametrize("bad", ["nan", "float64_overflow", "size", "unknown_key", "unknown_parameter", "settings"])
def test_a_bad_stage_state_is_rejected_by_the_engine_before_anything_is_assigned(bad):
    model, optimizer, stage = _stage_with_moments()
    engine = Engine(gradcomp.TopK(0.1), transform=stage)
    saved = engine.state_dict()
    transform = dict(saved["transform"])
    moments = dict(transform["moments"])
    name = next(iter(moments))
    if bad == "nan":
        moments[name] = torch.full_like(moments[name], float("nan"))
    elif bad == "float64_overflow":  # finite in float64, Inf in the float32 moment
        moments[name] = torch.full_like(moments[name], 1e300, dtype=torch.float64)
    elif bad == "size":
        moments[name] = moments[name][:-1]
    elif bad == "unknown_key":
        transform["velocity"] = {}
    elif bad == "unknown_parameter":
        moments["head.weight"] = moments[name]
    elif bad == "settings":
        transform["freeze_step"] = 2
    transform["moments"] = moments
    engine.step = 7
    before = {k: v.clone() for k, v in stage.moments.items()}
    with pytest.raises(ValueError):
        engine.prepare_load({**saved, "transform": transform})  # rejected in prepare, not in assign
    assert engine.step == 7
    assert before.keys() == stage.moments.keys() and all(torch.equal(before[k], stage.moments[k]) for k in before)


def test_a_good_stage_state_round_trips():
    _, _, stage = _stage_with_moments()
    saved = stage.state_dict()
    _, _, fresh = _stage_with_moments()
    for moment in fresh.moments.values():
        moment.zero_()
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.moments[k], stage.moments[k]) for k in stage.moments)


def test_the_frozen_denominator_does_not_depend_on_when_it_is_computed():
    """The variance stops at the freeze, so a denominator recomputed later (a checkpoint without it)
    is the one computed at the freeze."""
    model, optimizer, stage = _stage_with_moments()
    group = optimizer.param_groups[0]
    param = next(model.parameters())
    first = stage._denom(param, group).clone()
    optimizer.state[param]["step"] += 5
    del optimizer.state[param]["frozen_denom"]
    assert torch.equal(stage._denom(param, group), first)


def test_another_ranks_state_loads_with_a_warning_and_this_ranks_moments_forgotten():
    """The first moments are one rank's own, as its residuals: rank 0's state loaded by rank 1
    (a single file of rank 0 read everywhere) resets both, with a warning; the all-ranks form gives
    each rank its own part."""
    from gradcomp.checkpoint import all_ranks
    from gradcomp.transport import Transport

    class Rank(Transport):
        def __init__(self, rank):
            self.rank, self.world_size = rank, 2

    _, _, stage = _stage_with_moments()
    saved = Engine(gradcomp.TopK(0.1), Rank(0), transform=stage).state_dict()
    saved["residuals"] = {name: torch.ones(m.numel()) for name, m in stage.moments.items()}
    _, _, other = _stage_with_moments()
    engine = Engine(gradcomp.TopK(0.1), Rank(1), transform=other)
    with pytest.warns(UserWarning, match="saved by rank 0 .* loaded by rank 1"):
        engine.load_state_dict(saved)
    assert other.moments == {} and not engine.residual_memory.keys()
    mine = {**saved, "rank": 1, "residuals": {k: v * 2 for k, v in saved["residuals"].items()}}
    engine.load_state_dict(all_ranks([saved, mine]))
    assert all(torch.equal(engine.residual_memory.residual(k), v) for k, v in mine["residuals"].items())
    assert other.moments.keys() == stage.moments.keys()
