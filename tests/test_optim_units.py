"""FrozenVarianceAdam in one process: its checks, its units, its step, its transactions."""
import math

import pytest
import torch

import gradcomp
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.optim import FrozenVarianceAdam


def small_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def flat_grad(net):
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def keys_and_numels(net):
    return [n for n, _ in net.named_parameters()], [p.numel() for p in net.parameters()]


def train(net, optimizer, steps, seed=1):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(4, 6, generator=generator)).square().sum().backward()
        optimizer.step()


def test_refuses_what_the_frozen_step_cannot_be():
    net = small_net()
    with pytest.raises(TypeError, match="Adam or AdamW"):
        FrozenVarianceAdam(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(), freeze_step=10)
    for flag in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match=flag):
            FrozenVarianceAdam(torch.optim.Adam(net.parameters(), **{flag: True}), net.named_parameters(), 10)
    with pytest.raises(ValueError, match="freeze_step"):
        FrozenVarianceAdam(torch.optim.Adam(net.parameters()), net.named_parameters(), freeze_step=0)
    with pytest.raises(ValueError, match="exchange"):
        FrozenVarianceAdam(torch.optim.Adam(net.parameters()), net.named_parameters(), 10, exchange="velocity")
    params = list(net.parameters())
    with pytest.raises(ValueError, match="not in the optimizer"):
        FrozenVarianceAdam(torch.optim.Adam(params[:2]), net.named_parameters(), freeze_step=10)


@pytest.mark.parametrize("kind", ["adam-l2", "adamw"])
def test_gradient_exchange_round_trips_units_and_steps_adam_with_the_frozen_variance(kind):
    """What is compressed is g / d; the average comes back times d; the step is Adam's with the
    second moment of the freeze, on .grad as the loop left it."""
    net = small_net()
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    optimizer = cls(net.parameters(), lr=1e-2, weight_decay=0.1)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange="gradient")
    train(net, optimizer, 10)
    keys, numels = keys_and_numels(net)
    net(torch.ones(2, 6)).sum().backward()
    grad = flat_grad(net).clone()
    sent = stage.before_compress(keys, numels, grad)
    denoms = torch.cat([optimizer.state[p]["frozen_denom"].reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(sent, grad / denoms)
    back = sent.clone()
    stage.after_average(keys, numels, back, dense=False)
    torch.testing.assert_close(back, grad, rtol=1e-6, atol=0)
    # The step: exp_avg from .grad (with Adam's L2 term), the frozen denominator, bias correction.
    expected, given = [], []
    for p in net.parameters():
        state, g = optimizer.state[p], p.grad * 0.5  # a loop that scaled .grad (a clip) is obeyed
        p.grad = g.clone()
        given.append(g.clone())
        if kind == "adam-l2":
            g = g + 0.1 * p.detach()
        m = torch.lerp(state["exp_avg"], g, 0.1)
        start = p.detach() * (1 - 1e-2 * 0.1) if kind == "adamw" else p.detach()
        expected.append(start - 1e-2 / (1 - 0.9**11) * m / state["frozen_denom"])
    optimizer.step()
    for p, e, g in zip(net.parameters(), expected, given):
        torch.testing.assert_close(p.detach(), e)
        # .grad is as the loop left it before the step, as without gradcomp.
        assert torch.equal(p.grad, g) and int(optimizer.state[p]["step"]) == 11


def test_momentum_exchange_keeps_this_ranks_first_moment_transactionally():
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange="momentum")
    train(net, optimizer, 10)
    keys, numels = keys_and_numels(net)
    grad = torch.ones(sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    stage.before_compress(keys, numels, grad)
    stage.commit(keys, torch.tensor(False))  # a rejected step: the moment is where it started
    assert torch.equal(torch.cat([stage.moments[k] for k in keys]), start)
    sent = stage.before_compress(keys, numels, grad)
    stage.commit(keys, torch.tensor(True))
    moment = torch.lerp(start, grad, 0.1)
    assert torch.equal(torch.cat([stage.moments[k] for k in keys]), moment)
    denoms = torch.cat([optimizer.state[p]["frozen_denom"].reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(sent, moment / denoms)
    # The step applies .grad as the first moment: exp_avg becomes it.
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.25)
    optimizer.step()
    assert all(torch.equal(optimizer.state[p]["exp_avg"], torch.full_like(p, 0.25)) for p in net.parameters())


@pytest.mark.parametrize("compressor, user, beta1", [
    (gradcomp.TopK(0.01), 0.9, 0.8), (gradcomp.TopK(0.1), 0.9, 6.5 / 7.5), (gradcomp.ThreeBit(), 0.9, 0.9),
    (None, 0.9, 0.9), (gradcomp.TopK(0.01), 0.8, 16 / 25)])
def test_a_sparsified_first_moment_gives_up_error_feedbacks_delay(compressor, user, beta1):
    """Top-k's residual holds a coordinate back: the moment a sparsifier compresses forms with the shorter b1'
    (b1' / (1 - b1') = 9 - delay_at(density): 5 steps at 1 %, 2.5 at 10 %); a quantizer's or a dense step's with b1.
    A user's b1 of 0.8 gives up the same share of its 4 steps at 1 % (memory_share: 4/9 of 5 steps)."""
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(user, 0.999))
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange="momentum")
    train(net, optimizer, 10)
    keys, numels = keys_and_numels(net)
    grad = torch.linspace(-1, 1, sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    stage.before_compress(keys, numels, grad, compressor)
    stage.commit(keys)
    torch.testing.assert_close(torch.cat([stage.moments[k] for k in keys]), torch.lerp(start, grad, 1 - beta1))
    if beta1 == user:  # bitwise the user's b1, not a round trip through the delay's arithmetic
        assert torch.equal(torch.cat([stage.moments[k] for k in keys]), torch.lerp(start, grad, 1 - 0.9))


def test_every_parameter_of_a_per_parameter_payload_gives_up_the_delay_those_sent_whole_too():
    """Under a per-parameter top-k (the engine's default granularity) the group is held back at the base's
    density: every parameter's moment forms with b1', those under ``dense_below`` (sent whole) included."""
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange="momentum")
    train(net, optimizer, 10)
    keys, numels = keys_and_numels(net)
    wrapped = PerParameter(gradcomp.TopK(0.01), numels, dense_below=min(numels) + 1)
    grad = torch.linspace(-1, 1, sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    stage.before_compress(keys, numels, grad, wrapped)
    stage.commit(keys)
    torch.testing.assert_close(torch.cat([stage.moments[k] for k in keys]), torch.lerp(start, grad, 1 - 0.8))
    assert any(part.dense for part in wrapped.parts) and not all(part.dense for part in wrapped.parts)


def test_no_delay_given_up_with_delay_steps_zero_or_the_gradient_exchanged():
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    assert FrozenVarianceAdam(optimizer, net.named_parameters(), 10, exchange="gradient").delay_steps == 0
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), 10, exchange="momentum", delay_steps=0)
    train(net, optimizer, 10)
    keys, numels = keys_and_numels(net)
    grad = torch.linspace(-1, 1, sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    stage.before_compress(keys, numels, grad, gradcomp.TopK(0.01))
    stage.commit(keys)
    assert torch.equal(torch.cat([stage.moments[k] for k in keys]), torch.lerp(start, grad, 1 - 0.9))
    with pytest.raises(ValueError, match="delay_steps"):
        FrozenVarianceAdam(optimizer, net.named_parameters(), 10, exchange="momentum", delay_steps=-1)


def test_before_the_freeze_the_stage_changes_nothing():
    net, twin = small_net(), small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=20)
    train(net, optimizer, 5)
    train(twin, torch.optim.AdamW(twin.parameters(), lr=1e-2), 5)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))


def test_state_dict_holds_settings_moments_and_waits_only():
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters())
    gradient = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10)
    assert gradient.state_dict() == {"freeze_step": 10, "exchange": "gradient", "variance_floor": 0.1,
                                     "delay_steps": 0.0, "bounded": False, "suspended": False, "frozen_at": None,
                                     "latest_freeze": None, "gate": {"opened": 10, "lr_seen": None, "rising": False},
                                     "spike_guard": True, "live_level": True, "level": {},
                                     "guard": {"calls": 0, "observed": 0, "mean": None, "var": None},
                                     "waits": {}, "refresh": None, "refreshed_at": None}
    momentum = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange="momentum")
    assert momentum.state_dict()["delay_steps"] == 5.0
    older = {k: v for k, v in momentum.state_dict().items()
             if k not in ("delay_steps", "bounded", "latest_freeze", "gate", "spike_guard", "guard", "live_level",
                          "level", "refresh", "refreshed_at")}
    momentum.load_state_dict(older)  # saved before the settings existed: loads
    with pytest.raises(ValueError, match="bounded"):
        momentum.load_state_dict({**momentum.state_dict(), "bounded": True})
    with pytest.raises(ValueError, match="spike_guard"):
        momentum.load_state_dict({**momentum.state_dict(), "spike_guard": False})
    assert momentum.state_dict()["live_level"] is False  # the momentum exchange's default
    with pytest.raises(ValueError, match="live_level"):
        momentum.load_state_dict({**momentum.state_dict(), "live_level": True})
    settings = gradient.settings()
    assert math.isclose(dict(settings["optimizer"][0])["eps"], 1e-8)
    assert dict(settings["optimizer"][0])["lr"] == 1e-3


def test_the_stage_runs_after_the_steps_closure_and_before_the_update():
    from gradcomp.optim.step_hook import after_closure

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    seen = []  # (the gradient the stage saw, the parameter before the update)
    optimizer.register_step_pre_hook(after_closure(
        lambda: seen.append((None if param.grad is None else param.grad.clone(), param.detach().clone()))))

    def closure():
        optimizer.zero_grad(set_to_none=True)
        (param * torch.tensor([1.0, 2.0])).sum().backward()
        return torch.tensor(0.0)

    optimizer.step(closure)  # keyword-free, positional
    assert torch.equal(seen[-1][0], torch.tensor([1.0, 2.0])) and torch.equal(seen[-1][1], torch.zeros(2))
    assert torch.equal(param.detach(), torch.tensor([-1.0, -2.0]))  # the update followed the stage
    optimizer.step(closure=closure)
    assert torch.equal(seen[-1][1], torch.tensor([-1.0, -2.0])) and len(seen) == 2
    optimizer.zero_grad(set_to_none=True)
    optimizer.step()  # no closure: at once, on what .grad holds (nothing here)
    assert seen[-1][0] is None and len(seen) == 3


def frozen_denominators(optimizer, net, at_step, floor=0.1):
    """What the stage's denominators must be for a variance frozen at ``at_step``."""
    out = []
    for p in net.parameters():
        group, state = optimizer.param_groups[0], optimizer.state[p]
        sqrt_v = state["exp_avg_sq"].sqrt() / math.sqrt(1 - group["betas"][1] ** at_step)
        out.append(sqrt_v.clamp(min=float(sqrt_v.mean()) * floor) + group["eps"])
    return out


@pytest.mark.parametrize("exchange", ["gradient", "momentum"])
def test_a_suspended_stage_is_the_users_adam_continuing_the_frozen_variance(exchange):
    import copy

    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange=exchange)
    train(net, optimizer, 15)
    frozen = [optimizer.state[p]["frozen_denom"].clone() for p in net.parameters()]
    torch.testing.assert_close(frozen, frozen_denominators(optimizer, net, 10))
    stage.moments = {"0.weight": torch.zeros(60)}
    # the live level (the gradient exchange's) carries over: Adam's variance goes on from the frozen one times it
    ratio = stage.level.ratio(0) if exchange == "gradient" else 1.0
    assert (ratio != 1.0) == (exchange == "gradient") and (stage.level is None) == (exchange == "momentum")
    stage.suspend()
    assert stage.suspended and stage.moments == {} and stage.state_dict()["suspended"] is True
    beta2 = 0.999
    for p, before in zip(net.parameters(), frozen):
        state = optimizer.state[p]
        assert "frozen_denom" not in state and not stage.frozen(p)
        # Adam's bias-corrected variance at step 15 is the one frozen at step 10 (times the level).
        sqrt_v = (state["exp_avg_sq"] / (1 - beta2**15)).sqrt()
        torch.testing.assert_close(sqrt_v.clamp(min=float(sqrt_v.mean()) * 0.1) + 1e-8,
                                   (before - 1e-8) * math.sqrt(ratio) + 1e-8)
    # From here on the stage does nothing: the same steps as a plain AdamW from the same state.
    twin = copy.deepcopy(net)
    twin_optimizer = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.1)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not aliased
    train(net, optimizer, 3, seed=7)
    train(twin, twin_optimizer, 3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin.parameters()))
    # Back: the variance freezes again at this step's, 18.
    stage.resume()
    assert not stage.suspended and stage.frozen_at == 18
    expected = frozen_denominators(optimizer, net, 18)
    train(net, optimizer, 1, seed=8)
    torch.testing.assert_close([optimizer.state[p]["frozen_denom"] for p in net.parameters()], expected)


def test_the_suspension_is_checkpointed_and_checked():
    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10)
    train(net, optimizer, 12)
    stage.suspend()
    stage.resume()
    saved = stage.state_dict()
    assert (saved["suspended"], saved["frozen_at"]) == (False, 12)
    other = FrozenVarianceAdam(torch.optim.AdamW(net.parameters()), net.named_parameters(), freeze_step=10)
    other.load_state_dict(saved)
    assert (other.suspended, other.frozen_at) == (False, 12)
    for bad in ({"suspended": 1}, {"frozen_at": 0}, {"frozen_at": 2.5}):
        with pytest.raises(ValueError, match="suspended"):
            other.load_state_dict({**saved, **bad})
    assert (other.suspended, other.frozen_at) == (False, 12)
    # A checkpoint saved before the suspension existed loads as not suspended, frozen at freeze_step.
    other.load_state_dict({"freeze_step": 10, "exchange": "gradient", "variance_floor": 0.1})
    assert (other.suspended, other.frozen_at) == (False, None)


def _notices_under(lrs, freeze_step=3):
    """The RecipeNotices of a run whose learning rate is set by hand to ``lrs[step]`` before each step."""
    import warnings

    net = small_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lrs[0])
    FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=freeze_step)
    generator = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lr in lrs:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad()
            net(torch.randn(4, 6, generator=generator)).square().sum().backward()
            optimizer.step()
    return [str(w.message) for w in caught if issubclass(w.category, gradcomp.RecipeNotice)]


def test_a_freeze_inside_a_hand_set_warm_up_is_said_once():
    """The variance freezes after 3 steps of an 8-step warm-up set by hand: one notice, naming the rise."""
    notices = _notices_under([1e-3 * min(1.0, (step + 1) / 8) for step in range(12)])
    assert len(notices) == 1, notices
    assert "froze after 3 steps" in notices[0] and "0.0005 at the freeze, 0.000625 1 steps later" in notices[0]
    # The warm-up over before the freeze, a decaying rate, a rise long after the freeze: nothing to say.
    assert _notices_under([1e-3] * 12) == []
    assert _notices_under([1e-3 * 0.9 ** step for step in range(12)]) == []
    assert _notices_under([1e-3] * 8 + [2e-3] * 4) == []
