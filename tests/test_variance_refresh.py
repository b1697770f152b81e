"""FrozenVarianceAdam's refreshes (gradcomp.optim.variance_refresh): the variance takes a sample of what the
exchange delivered at steps spaced by its memory, and the denominators freeze again from it.

In-process, the stage driven as the engine drives it (the averages set as ``.grad``, a sparsifier's keys recorded
before the step, then the optimizer's step): the refresh against the formula computed here (the first moment's
square, or a sparsifier's average over each coordinate's wait), its schedule, a parameter without a gradient,
``refresh=None`` frozen for good, suspension, checkpoints (the refresh step saved, older ones loaded, bad ones
refused). The recipe's runs on real Gloo ranks are in test_recipe.py and test_grad_contract.py; the quality
figure in experiments/results/research-teacher-variance/.
"""
import math

import pytest
import torch

from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.adam_settings import VARIANCE_FLOOR
from gradcomp.optim.variance_refresh import WEIGHT, renewed

FREEZE, BETA2 = 3, 0.99  # refreshes at every step from 4 to 22, then 24, 26, ..., 50, 53, ... (_schedule)
pytestmark = pytest.mark.filterwarnings("ignore:gradcomp. freezing Adam's variance after 3 steps")


def _run(steps, refresh=WEIGHT, seed=0, skip=None, stop=None, sparse=False):
    """A stage over two parameters frozen after ``FREEZE`` dense steps, ``steps`` optimizer steps of seeded
    gradients (``skip``: the step at which "b" has none; ``sparse``: "a" is a sparsifier's from the freeze on, its
    gradient zero on a fixed half of its coordinates, the others released); returns ``(stage, params, {step:
    ([exp_avg_sq before the step], grads, [exp_avg before the step], waits of "a" before the step)})``;
    ``stop(stage, step)`` may end the run early (returns True)."""
    gen = torch.Generator().manual_seed(seed)
    params = [("a", torch.nn.Parameter(torch.randn(5, 4, generator=gen))),
              ("b", torch.nn.Parameter(torch.randn(7, generator=gen)))]
    optimizer = torch.optim.AdamW([p for _, p in params], lr=1e-2, betas=(0.9, BETA2))
    stage = FrozenVarianceAdam(optimizer, params, freeze_step=FREEZE, spike_guard=False, refresh=refresh)
    held = torch.arange(20).view(5, 4) % 2 == 0  # "a"'s coordinates a sparsifier holds back
    seen = {}
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen) * 0.9 ** step for _, p in params]
        if sparse and step >= FREEZE:
            grads[0] = grads[0].masked_fill(held, 0.0)
            stage.catch_up.compressed.add("a")  # as the engine records a sparsifier's keys
        for (name, p), g in zip(params, grads):
            p.grad = None if (name == "b" and step == skip) else g.clone()
        states = [optimizer.state.get(p, {}) for _, p in params]
        waits = stage.catch_up.waits.get("a")
        seen[step] = ([state["exp_avg_sq"].clone() if state else None for state in states], grads,
                      [state["exp_avg"].clone() if state else None for state in states],
                      None if waits is None else waits.clone())
        optimizer.step()
        if stop is not None and stop(stage, step):
            break
    return stage, params, seen


def _schedule(last_step, freeze=FREEZE, beta2=BETA2, weight=WEIGHT):
    """The optimizer steps (1-based) of the refreshes up to ``last_step``: each the first at which the steps since
    the last refresh (or the freeze) hold ``weight`` of Adam's bias-corrected variance."""
    marks, last = [], freeze
    for t in range(freeze + 1, last_step + 1):
        if (1 - beta2 ** (t - last)) / (1 - beta2 ** t) >= weight:
            marks.append(t)
            last = t
    return marks


def test_the_share_renewed_is_adams_and_the_refreshes_thin_out_to_its_memory():
    assert renewed(0.999, 52, 10 ** 6) >= WEIGHT > renewed(0.999, 51, 10 ** 6)  # late: every 52 steps
    assert renewed(0.999, 1, 18) >= WEIGHT and renewed(0.999, 3, 70) < WEIGHT <= renewed(0.999, 4, 70)
    assert renewed(0.95, 1, 10 ** 6) >= WEIGHT and renewed(1.0, 1, 5) == 1.0
    marks = _schedule(400, freeze=17, beta2=0.999)
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    assert marks[:3] == [18, 19, 20] and gaps == sorted(gaps) and gaps[-1] < 52


def _spaced():
    """The first two refreshes more than a step apart."""
    marks = _schedule(60)
    return next((a, b) for a, b in zip(marks, marks[1:]) if b - a > 1)


def _denom(variance, t):
    sqrt_v = variance.sqrt() / math.sqrt(1 - BETA2 ** t)
    return sqrt_v.clamp(min=float(sqrt_v.mean()) * VARIANCE_FLOOR) + 1e-8


def test_a_refresh_takes_the_first_moment_as_adam_would_have_over_the_steps_since_the_last():
    """At a refresh ``k > 1`` steps after the last: ``v = b2^k v + (1 - b2^k) m^2`` for the first moment
    before the step, the denominators ``sqrt(v / (1 - b2^t))`` (floored, plus eps) at that step."""
    first, second = _spaced()
    stage, params, seen = _run(second)
    assert stage.refreshed_at == second and second - first > 1
    k, index_of = second - first, second - 1  # the step index whose gradient is Adam's second-th
    for index, (_, p) in enumerate(params):
        state = stage.optimizer.state[p]
        v_before, moment = seen[index_of][0][index], seen[index_of][2][index]
        assert torch.equal(seen[first][0][index], v_before)  # untouched between the refreshes
        expected = v_before * BETA2 ** k + (1 - BETA2 ** k) * moment * moment
        torch.testing.assert_close(state["exp_avg_sq"], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(state["frozen_denom"], _denom(expected, second), rtol=1e-6, atol=0)
        refreshed = state.pop("frozen_denom")  # the refresh's batched denominators: the stage's own, bit for bit
        assert torch.equal(refreshed, stage._denom(p, stage.optimizer.param_groups[0]))


def test_under_a_sparsifier_the_average_over_each_wait_and_zero_where_held_back():
    """"a" is a sparsifier's: ``v = b2^k v + (1 - b2^k) (g / (w + 1))^2`` with the waits before the step, so where
    a coordinate was held back (``g = 0``) its variance decays as Adam's under a zero gradient; "b" (no waits)
    takes its first moment."""
    first, second = _spaced()
    stage, params, seen = _run(second, sparse=True)
    assert stage.refreshed_at == second
    k, index_of = second - first, second - 1
    v_before, grad, waits = seen[index_of][0][0], seen[index_of][1][0], seen[index_of][3]
    assert waits is not None and int(waits.max()) > 0  # the caught-up steps advanced them
    held = grad == 0
    expected = v_before * BETA2 ** k + (1 - BETA2 ** k) * (grad / (waits.float() + 1)).square()
    variance = stage.optimizer.state[params[0][1]]["exp_avg_sq"]
    torch.testing.assert_close(variance, expected, rtol=1e-6, atol=0)
    assert held.any() and torch.equal(variance[held], v_before[held] * BETA2 ** k)
    moment = seen[index_of][2][1]
    torch.testing.assert_close(stage.optimizer.state[params[1][1]]["exp_avg_sq"],
                               seen[index_of][0][1] * BETA2 ** k + (1 - BETA2 ** k) * moment * moment,
                               rtol=1e-6, atol=0)


def test_refreshes_come_when_due_and_a_parameter_without_a_gradient_decays():
    marks, expected = [], _schedule(60)
    skip = expected[3] - 1  # "b" has no gradient at the fourth refresh
    stage, params, seen = _run(60, skip=skip, stop=lambda stage, step: marks.append(stage.refreshed_at) and False)
    assert [m for m in dict.fromkeys(marks) if m is not None] == expected
    k = expected[3] - expected[2]
    assert torch.equal(seen[skip + 1][0][1], seen[skip][0][1] * BETA2 ** k)
    assert not torch.equal(seen[skip + 1][0][0], seen[skip][0][0] * BETA2 ** k)


def test_refresh_none_keeps_the_variance_frozen_for_good():
    p = torch.nn.Parameter(torch.zeros(3))
    assert FrozenVarianceAdam(torch.optim.Adam([p]), [("p", p)], freeze_step=20).refresh is None  # the default
    stage, params, seen = _run(30, refresh=None)
    assert stage.refreshed_at is None
    for index, (_, p) in enumerate(params):
        assert torch.equal(stage.optimizer.state[p]["exp_avg_sq"], seen[FREEZE][0][index])


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, float("nan")])
def test_a_bad_refresh_share_is_refused(bad):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="refresh"):
        FrozenVarianceAdam(torch.optim.Adam([p]), [("p", p)], freeze_step=2, refresh=bad)


def test_suspension_forgets_the_refresh_and_resuming_freezes_again_there():
    first = _schedule(40)[0]
    stage, params, _ = _run(first)
    assert stage.refreshed_at == first
    stage.suspend()
    assert stage.refreshed_at is None and all("frozen_denom" not in stage.optimizer.state[p] for _, p in params)
    stage.resume()
    assert stage.frozen_at == first and stage.variance_at() == stage.frozen_at


def test_a_checkpoint_carries_the_refresh_and_the_run_continues_bitwise():
    marks = _schedule(60)
    middle, end = marks[19], marks[21] + 1  # saved just after a refresh; run on past two more
    whole, params, _ = _run(end)
    half, half_params, _ = _run(middle)
    saved = {"stage": half.state_dict(), "optimizer": half.optimizer.state_dict()}
    assert saved["stage"]["refreshed_at"] == middle and saved["stage"]["refresh"] == WEIGHT
    fresh, fresh_params, _ = _run(0)
    for (_, p), (_, q) in zip(fresh_params, half_params):
        p.data.copy_(q.data)
    fresh.optimizer.load_state_dict(saved["optimizer"])
    fresh.load_state_dict(saved["stage"])
    assert fresh.refreshed_at == middle
    gen = torch.Generator().manual_seed(0)  # replay the gradients of the whole run from the half's next step
    torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)  # the parameters' draws
    for step in range(end):
        grads = [torch.randn(p.shape, generator=gen) * 0.9 ** step for _, p in fresh_params]
        if step < middle:
            continue
        for (_, p), g in zip(fresh_params, grads):
            p.grad = g
        fresh.optimizer.step()
    assert fresh.refreshed_at == whole.refreshed_at == marks[21]
    for (_, p), (_, q) in zip(fresh_params, params):
        assert torch.equal(p, q)


def test_older_checkpoints_load_and_bad_refresh_steps_are_refused_before_any_change():
    stage, _, _ = _run(_schedule(40)[0])
    old = stage.state_dict()
    del old["refreshed_at"], old["refresh"]
    target, _, _ = _run(FREEZE + 1)
    target.load_state_dict(old)
    assert target.refreshed_at is None
    for bad in (0, -3, "7", 2.5):
        saved = {**stage.state_dict(), "refreshed_at": bad}
        with pytest.raises(ValueError, match="refreshed_at"):
            target.load_state_dict(saved)
        assert target.refreshed_at is None
    with pytest.raises(ValueError, match="settings"):
        target.load_state_dict({**stage.state_dict(), "refresh": 0.2})

