"""SpikeGuard alone and inside FrozenVarianceAdam: when it scales a frozen step, by how much, and its checkpoint."""
import math

import pytest
import torch

from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.spike_guard import SUSPENDED_STRIDE, SpikeGuard, live_denominators, scaled


def feed(guard, values, frozen=True):
    """The factors the guard returns for steps whose ``r`` (rms of grads / denoms) is each of ``values``."""
    denom = [torch.ones(100)]
    return [float(guard.scale([torch.full((100,), float(v))], denom, frozen)) for v in values]


def steady(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(n, generator=generator)).tolist()


def test_the_first_steps_are_left_out_and_a_warm_guard_scales_a_jump_back_to_its_limit():
    guard = SpikeGuard()
    assert feed(guard, [300.0, 50.0, 20.0]) == [1.0] * 3  # Adam's first steps: neither scaled nor observed
    assert guard.observed == 0
    assert feed(guard, steady(4) + [5.0] + steady(4)) == [1.0] * 9  # not warmed up: a jump passes
    history = steady(80, seed=1)
    factors = feed(guard, history)
    assert max(history) < 1.4 and all(f == 1.0 for f in factors)  # steady values are never scaled
    limit = float(guard.mean + guard.z * guard.var.sqrt())
    assert 1.0 < limit < 2.0
    (factor,) = feed(guard, [6.0])
    assert math.isclose(factor * 6.0, limit, rel_tol=1e-5)  # the step lands on the limit
    assert float(guard.mean) < limit  # and the averages took the limit, not the jump


def test_outside_the_frozen_phase_nothing_is_scaled():
    dense, frozen = SpikeGuard(), SpikeGuard()
    for guard in (dense, frozen):
        feed(guard, [1.0] * 3 + steady(30))
    assert feed(dense, [8.0], frozen=False) == [1.0]
    assert feed(frozen, [8.0], frozen=True)[0] < 0.25


def test_r_is_the_root_mean_square_over_every_element_in_update_units():
    guard = SpikeGuard(skip=0)
    grads = [torch.full((3,), 2.0), torch.full((1,), 4.0)]
    denoms = [torch.full((3,), 2.0), torch.full((1,), 1.0)]
    guard.scale(grads, denoms, frozen=False)
    assert math.isclose(float(guard.mean), math.sqrt((3 * 1.0 + 16.0) / 4), rel_tol=1e-6)


def test_a_resumed_guard_continues_bitwise_and_bad_state_is_refused():
    values = [1.0] * 3 + steady(30) + [7.0, 1.1, 9.0]
    whole, first = SpikeGuard(), SpikeGuard()
    expected = feed(whole, values)
    feed(first, values[:20])
    resumed = SpikeGuard()
    resumed.prepare_load(first.state_dict())()
    assert feed(resumed, values[20:]) == expected[20:]
    for bad in ({}, {**first.state_dict(), "calls": -1}, {**first.state_dict(), "mean": float("nan")},
                {**first.state_dict(), "mean": None}):
        with pytest.raises(ValueError, match="spike guard"):
            SpikeGuard().prepare_load(bad)
    with pytest.raises(ValueError, match="alpha"):
        SpikeGuard(alpha=1.0)


def run(spike_guard, spike_at=None, steps=30, freeze_step=10):
    """A small net under AdamW on one fixed batch (its gradient changes smoothly), frozen at ``freeze_step``;
    the loop multiplies ``.grad`` by 30 at ``spike_at``. Returns the net, the parameters' move at each step and
    the gradients the loop saw after each ``optimizer.step()``."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=freeze_step, spike_guard=spike_guard)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    moves, grads = [], []
    for step in range(steps):
        optimizer.zero_grad()
        net(batch).square().sum().backward()
        if step == spike_at:
            for p in net.parameters():
                p.grad.mul_(30.0)
        before = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
        seen = torch.cat([p.grad.reshape(-1).clone() for p in net.parameters()])
        optimizer.step()
        grads.append((seen, torch.cat([p.grad.reshape(-1) for p in net.parameters()])))
        moves.append(float((torch.cat([p.detach().reshape(-1) for p in net.parameters()]) - before).norm()))
    return net, moves, grads


def test_inside_the_stage_a_steady_run_is_bitwise_unguarded_and_a_spike_after_the_freeze_moves_less():
    guarded, _, grads = run(True)
    plain, plain_moves, _ = run(False)
    assert all(torch.equal(a, b) for a, b in zip(guarded.parameters(), plain.parameters()))
    assert all(torch.equal(seen, after) for seen, after in grads)  # .grad is the loop's after the step
    _, spiked_guarded, grads = run(True, spike_at=20)
    _, spiked_plain, _ = run(False, spike_at=20)
    assert spiked_plain[20] > 5 * plain_moves[20]  # unguarded, the frozen step passes the jump through
    assert spiked_guarded[20] < spiked_plain[20] / 3
    assert all(torch.equal(seen, after) for seen, after in grads)  # scaled on the stage's copy only


def test_a_spike_in_the_dense_start_is_left_to_adam():
    _, guarded, _ = run(True, spike_at=8, steps=9)
    _, plain, _ = run(False, spike_at=8, steps=9)
    assert guarded == plain


def test_scaled_copies_only_where_the_factor_is_not_one():
    grads = [torch.ones(3), torch.full((2,), 2.0)]
    assert scaled(grads, None) is grads
    assert scaled(grads, torch.tensor(1.0)) is grads
    halved = scaled(grads, torch.tensor(0.5))
    assert [h.tolist() for h in halved] == [[0.5] * 3, [1.0] * 2]
    assert [g.tolist() for g in grads] == [[1.0] * 3, [2.0] * 2]  # the loop's .grad is not mutated


def test_live_denominators_are_adams_per_parameter_formula_bitwise():
    generator = torch.Generator().manual_seed(3)
    variances = [torch.rand(1000, generator=generator) * 10.0 ** -k for k in range(1, 9)] + [torch.zeros(5)]
    bias, eps = 1 - 0.999 ** 7, 1e-8
    made = live_denominators(variances, bias, eps)
    assert all(torch.equal(d, (v / bias).sqrt_().add_(eps)) for d, v in zip(made, variances))
    assert all(d.data_ptr() != v.data_ptr() for d, v in zip(made, variances))  # exp_avg_sq is only read


def test_a_suspended_stage_keeps_its_guard_current_on_one_step_in_the_stride():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))

    def steps(count):
        for _ in range(count):
            optimizer.zero_grad()
            net(batch).square().sum().backward()
            optimizer.step()

    steps(14)
    assert stage.guard.calls == 14  # the dense start and the frozen steps: every step
    stage.suspend()
    steps(4 * SUSPENDED_STRIDE)
    assert stage.guard.calls == 14 + 4  # suspended: the steps whose optimizer step count is a multiple of it
    mean = float(stage.guard.mean)
    stage.resume()
    steps(3)
    assert stage.guard.calls == 14 + 4 + 3 and float(stage.guard.mean) != mean  # resumed: every step again
