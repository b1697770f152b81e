"""FrozenVarianceAdam's refreshes (gradcomp.optim.variance_refresh): the variance takes a sample of what the
exchange delivered at steps spaced by its memory, and the denominators freeze again from it.

In-process, the stage driven as the engine drives it (the averages set as ``.grad``, a sparsifier's keys recorded
before the step, then the optimizer's step): the refresh against the formula computed here (the first moment's
square, or a sparsifier's released coordinates over their waits), its spacing, a parameter without a gradient,
``refresh=None`` frozen for good, suspension, checkpoints (the refresh step saved, older ones loaded, bad ones
refused). The recipe's runs on real Gloo ranks are in test_recipe.py and test_grad_contract.py; the quality
figure in experiments/results/research-teacher-variance/.
"""
import math

import pytest
import torch

from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.adam_settings import VARIANCE_FLOOR
from gradcomp.optim.variance_refresh import WEIGHT, spacing

FREEZE, BETA2 = 3, 0.99  # spacing(0.99) = 6 steps
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


def test_the_spacing_renews_the_weight_of_the_variance():
    assert spacing(0.999) == 52 and spacing(0.99) == 6 and spacing(0.95) == 1
    for beta2 in (0.9, 0.99, 0.999, 0.9999):
        k = spacing(beta2)
        assert 1 - beta2 ** k >= WEIGHT and (k == 1 or 1 - beta2 ** (k - 1) < WEIGHT)


def _denom(variance, t):
    sqrt_v = variance.sqrt() / math.sqrt(1 - BETA2 ** t)
    return sqrt_v.clamp(min=float(sqrt_v.mean()) * VARIANCE_FLOOR) + 1e-8


def test_a_refresh_takes_the_first_moment_as_adam_would_have_over_the_steps_since_the_freeze():
    """At the 6th frozen step: ``v = b2^6 v_F + (1 - b2^6) m^2`` for the first moment before the step, the
    denominators ``sqrt(v / (1 - b2^t))`` (floored, plus eps) at that step; none before it."""
    k = spacing(BETA2)
    stage, params, seen = _run(FREEZE + k)
    refreshed = FREEZE + k - 1  # the step index whose gradient is Adam's (FREEZE + k)-th
    assert stage.refreshed_at == FREEZE + k
    for index, (_, p) in enumerate(params):
        state = stage.optimizer.state[p]
        v_frozen, moment = seen[refreshed][0][index], seen[refreshed][2][index]
        assert torch.equal(seen[FREEZE][0][index], v_frozen)  # untouched between the freeze and the refresh
        expected = v_frozen * BETA2 ** k + (1 - BETA2 ** k) * moment * moment
        torch.testing.assert_close(state["exp_avg_sq"], expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(state["frozen_denom"], _denom(expected, FREEZE + k), rtol=1e-6, atol=0)


def test_under_a_sparsifier_only_the_released_coordinates_take_their_burst_over_its_wait():
    """"a" is a sparsifier's: where its average is nonzero, ``v = b2^6 v_F + (1 - b2^6) (g / (w + 1))^2`` with the
    waits before the step; where it is zero the bias-corrected variance (hence the denominator) is unchanged; "b"
    (no waits) takes its first moment."""
    k = spacing(BETA2)
    stage, params, seen = _run(FREEZE + k, sparse=True)
    refreshed = FREEZE + k - 1
    assert stage.refreshed_at == FREEZE + k
    v_frozen, grad, waits = seen[refreshed][0][0], seen[refreshed][1][0], seen[refreshed][3]
    assert waits is not None and int(waits.max()) > 0  # the caught-up steps advanced them
    released = grad != 0
    burst = (grad / (waits.float() + 1)).square()
    held = (1 - BETA2 ** (FREEZE + k)) / (1 - BETA2 ** FREEZE)  # the held-back coordinates' v_hat unchanged
    expected = torch.where(released, v_frozen * BETA2 ** k + (1 - BETA2 ** k) * burst, v_frozen * held)
    variance = stage.optimizer.state[params[0][1]]["exp_avg_sq"]
    torch.testing.assert_close(variance, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(_denom(variance, FREEZE + k)[~released], _denom(v_frozen, FREEZE)[~released],
                               rtol=1e-5, atol=0)
    moment = seen[refreshed][2][1]
    torch.testing.assert_close(stage.optimizer.state[params[1][1]]["exp_avg_sq"],
                               seen[refreshed][0][1] * BETA2 ** k + (1 - BETA2 ** k) * moment * moment,
                               rtol=1e-6, atol=0)


def test_refreshes_come_every_spacing_steps_and_a_parameter_without_a_gradient_decays():
    k = spacing(BETA2)
    marks = []
    stage, params, seen = _run(FREEZE + 3 * k, skip=FREEZE + 2 * k - 1,
                               stop=lambda stage, step: marks.append(stage.refreshed_at) and False)
    assert [m for m in dict.fromkeys(marks) if m is not None] == [FREEZE + k, FREEZE + 2 * k, FREEZE + 3 * k]
    # "b" had no gradient at the second refresh: its variance only decayed there
    assert torch.equal(seen[FREEZE + 2 * k][0][1], seen[FREEZE + 2 * k - 1][0][1] * BETA2 ** k)
    assert not torch.equal(seen[FREEZE + 2 * k][0][0], seen[FREEZE + 2 * k - 1][0][0] * BETA2 ** k)


def test_refresh_none_keeps_the_variance_frozen_for_good():
    p = torch.nn.Parameter(torch.zeros(3))
    assert FrozenVarianceAdam(torch.optim.Adam([p]), [("p", p)], freeze_step=20).refresh is None  # the default
    stage, params, seen = _run(FREEZE + 4 * spacing(BETA2), refresh=None)
    assert stage.refreshed_at is None
    for index, (_, p) in enumerate(params):
        assert torch.equal(stage.optimizer.state[p]["exp_avg_sq"], seen[FREEZE][0][index])


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.5, float("nan")])
def test_a_bad_refresh_share_is_refused(bad):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="refresh"):
        FrozenVarianceAdam(torch.optim.Adam([p]), [("p", p)], freeze_step=2, refresh=bad)


def test_suspension_forgets_the_refresh_and_resuming_freezes_again_there():
    stage, params, _ = _run(FREEZE + spacing(BETA2))
    assert stage.refreshed_at is not None
    stage.suspend()
    assert stage.refreshed_at is None and all("frozen_denom" not in stage.optimizer.state[p] for _, p in params)
    stage.resume()
    assert stage.frozen_at == FREEZE + spacing(BETA2) and stage.variance_at() == stage.frozen_at


def test_a_checkpoint_carries_the_refresh_and_the_run_continues_bitwise():
    k = spacing(BETA2)
    whole, params, _ = _run(FREEZE + 2 * k + 2)
    half, half_params, _ = _run(FREEZE + k + 1)
    saved = {"stage": half.state_dict(), "optimizer": half.optimizer.state_dict()}
    assert saved["stage"]["refreshed_at"] == FREEZE + k and saved["stage"]["refresh"] == WEIGHT
    fresh, fresh_params, _ = _run(0)
    for (_, p), (_, q) in zip(fresh_params, half_params):
        p.data.copy_(q.data)
    fresh.optimizer.load_state_dict(saved["optimizer"])
    fresh.load_state_dict(saved["stage"])
    assert fresh.refreshed_at == FREEZE + k
    gen = torch.Generator().manual_seed(0)  # replay the gradients of the whole run from the half's next step
    torch.randn(5, 4, generator=gen), torch.randn(7, generator=gen)  # the parameters' draws
    for step in range(FREEZE + 2 * k + 2):
        grads = [torch.randn(p.shape, generator=gen) * 0.9 ** step for _, p in fresh_params]
        if step < FREEZE + k + 1:
            continue
        for (_, p), g in zip(fresh_params, grads):
            p.grad = g
        fresh.optimizer.step()
    assert fresh.refreshed_at == whole.refreshed_at == FREEZE + 2 * k
    for (_, p), (_, q) in zip(fresh_params, params):
        assert torch.equal(p, q)


def test_older_checkpoints_load_and_bad_refresh_steps_are_refused_before_any_change():
    stage, _, _ = _run(FREEZE + spacing(BETA2))
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

