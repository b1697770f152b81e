"""LiveLevel alone and inside FrozenVarianceAdam: the level each param group's frozen steps follow; its checkpoint."""
import copy
import math

import pytest
import torch

from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.live_level import LiveLevel


def test_the_factor_is_sqrt_n0_over_adams_average_of_the_mean_square():
    level = LiveLevel()
    denoms = [torch.full((3,), 2.0 + 1e-8), torch.full((5,), 4.0 + 1e-8)]
    n0 = (3 * 4.0 + 5 * 16.0) / 8
    grads = [torch.full((3,), 1.0), torch.full((5,), 3.0)]
    ms = (3 * 1.0 + 5 * 9.0) / 8
    n = 0.9 * n0 + 0.1 * ms
    assert math.isclose(float(level.factor(0, grads, denoms, 0.9, 1e-8)), math.sqrt(n0 / n), rel_tol=1e-6)
    # The guard's factor scales what the level sees and what it returns; the level goes on from n.
    guard = torch.tensor(0.5)
    n = 0.9 * n + 0.1 * ms * 0.25
    assert math.isclose(float(level.factor(0, grads, denoms, 0.9, 1e-8, guard)), 0.5 * math.sqrt(n0 / n),
                        rel_tol=1e-6)
    assert math.isclose(level.ratio(0), n / n0, rel_tol=1e-6) and level.ratio(1) == 1.0
    # Each group its own level; gradients that shrink make the group's steps grow, toward sqrt(n0 / ms).
    small = [g * 0.1 for g in grads]
    factors = [float(level.factor(1, small, denoms, 0.9, 1e-8)) for _ in range(200)]
    assert factors == sorted(factors) and math.isclose(factors[-1], math.sqrt(n0 / (ms * 0.01)), rel_tol=1e-3)
    # A group whose dense start saw no gradient (denominators eps) keeps its frozen steps.
    assert float(level.factor(2, grads, [torch.full((3,), 1e-8), torch.full((5,), 1e-8)], 0.9, 1e-8)) == 1.0


def test_a_resumed_level_continues_bitwise_and_bad_state_is_refused():
    denoms, grads = [torch.linspace(0.5, 2.0, 10)], [torch.linspace(-1.0, 1.0, 10)]
    whole, first = LiveLevel(), LiveLevel()
    expected = [float(whole.factor(0, [g * 0.9 ** i for g in grads], denoms, 0.99, 1e-8)) for i in range(20)]
    for i in range(8):
        first.factor(0, [g * 0.9 ** i for g in grads], denoms, 0.99, 1e-8)
    resumed = LiveLevel()
    resumed.prepare_load(first.state_dict(), groups=1)()
    assert [float(resumed.factor(0, [g * 0.9 ** i for g in grads], denoms, 0.99, 1e-8))
            for i in range(8, 20)] == expected[8:]
    for bad in ([], {0: (1.0,)}, {0: (1.0, float("nan"))}, {0: (1.0, -1.0)}, {1: (1.0, 1.0)}, {"0": (1.0, 1.0)}):
        with pytest.raises(ValueError, match="live level"):
            LiveLevel().prepare_load(bad, groups=1)


def two_group_run(live_level, steps=40, freeze_step=10, shrink=None, stop=None, resume_from=None):
    """Four parameters in two param groups under AdamW (``betas`` (0.9, 0.9): a level that moves within the run, no
    weight decay), frozen at ``freeze_step``, each step's ``.grad`` a fresh draw of unit noise (the same whatever the
    parameters: runs compare step for step); from the freeze on the first group's ``.grad`` is times ``shrink``.
    Returns (parameters, each step's move of each, stage); ``stop``: (parameters, optimizer, stage) after that many
    steps; ``resume_from``: such a triple's checkpoints, loaded into fresh ones that run the remaining steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((10, 6), (10,), (3, 10), (3,))]
    groups = [{"params": params[:2]}, {"params": params[2:]}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.9), weight_decay=0.0)
    stage = FrozenVarianceAdam(optimizer, [(str(i), p) for i, p in enumerate(params)], freeze_step=freeze_step,
                               live_level=live_level)
    start = 0
    if resume_from is not None:
        saved_params, saved_optimizer, saved_stage = resume_from
        with torch.no_grad():
            for p, saved in zip(params, saved_params):
                p.copy_(saved)
        optimizer.load_state_dict(copy.deepcopy(saved_optimizer.state_dict()))
        stage.load_state_dict(saved_stage.state_dict())
        start = int(optimizer.state[params[0]]["step"])
    generator = torch.Generator().manual_seed(1)
    noise = [[torch.randn(p.shape, generator=generator) for p in params] for _ in range(steps)]
    moves = []
    for step in range(start, steps if stop is None else stop):
        for i, p in enumerate(params):
            p.grad = noise[step][i] * (shrink if shrink is not None and step >= freeze_step and i < 2 else 1.0)
        before = [p.detach().clone() for p in params]
        optimizer.step()
        moves.append([float((p.detach() - b).norm()) for p, b in zip(params, before)])
    return (params, optimizer, stage) if stop is not None else (params, moves, stage)


def test_inside_the_stage_each_groups_frozen_steps_follow_its_own_gradients():
    _, frozen_moves, _ = two_group_run(False, shrink=0.1, steps=80)
    _, live_moves, stage = two_group_run(True, shrink=0.1, steps=80)
    # The dense start is Adam's own, with or without the level.
    assert live_moves[:10] == frozen_moves[:10]
    # The shrunk group: a frozen variance steps 10x smaller; the live level takes it back toward Adam's step.
    # (after 60 steps of b2 = 0.9 the level is 0.01 of the frozen one: steps about 10x those frozen)
    first = [live[0] / frozen[0] for live, frozen in zip(live_moves[70:], frozen_moves[70:])]
    assert min(first) > 7.0, first
    assert stage.level.ratio(0) < 0.05 and 0.5 < stage.level.ratio(1) < 2.0
    # The other group's level follows its own gradients, not the shrunk group's.
    _, unshrunk_moves, _ = two_group_run(True, steps=80)
    assert [m[2:] for m in live_moves] == [m[2:] for m in unshrunk_moves]


def test_a_stage_resumed_from_its_checkpoint_continues_bitwise():
    whole, _, _ = two_group_run(True, shrink=0.3)
    saved = two_group_run(True, shrink=0.3, stop=25)
    assert saved[2].state_dict()["level"] and set(saved[2].state_dict()["level"]) == {0, 1}
    resumed, _, _ = two_group_run(True, shrink=0.3, resume_from=saved)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    # Without the levels (a checkpoint of a run before they existed) the run differs: they carry state.
    older = {k: v for k, v in saved[2].state_dict().items() if k not in ("live_level", "level")}
    saved[2].state_dict = lambda: older
    restarted, _, _ = two_group_run(True, shrink=0.3, resume_from=saved)
    assert not all(torch.equal(a, b) for a, b in zip(whole, restarted))
