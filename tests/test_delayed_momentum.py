"""DelayedMomentumSGD: SGD-momentum's stage under a sparsifier (gradcomp.optim.delayed_momentum).

In-process: the stage's update is checked against torch's own SGD run with the shortened momentum on the
rescaled buffer; the recipe's choice of it, and its run on real Gloo ranks, are in test_recipe.py."""
import copy

import pytest
import torch

from gradcomp.compressors import ThreeBit, TopK
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.optim import DelayedMomentumSGD
from gradcomp.optim.delayed_momentum import (
    DELAY_DENSITY,
    DELAY_MOMENTUM,
    DELAY_STEPS,
    compressed_momentum,
    delay_at,
    memory_share,
    stable_delay,
)


def test_a_shorter_memory_gives_up_the_same_share_of_itself_and_a_longer_one_the_screened_steps():
    """memory_share(beta): m / m0 below DELAY_MOMENTUM (m = beta / (1 - beta)), 1 at and above it, so the study's
    loops (momentum 0.9) give up DELAY_STEPS bit for bit."""
    assert DELAY_MOMENTUM == 0.9 and memory_share(0.9) == 1.0 and memory_share(0.99) == 1.0
    assert memory_share(0.8) == pytest.approx(4 / 9) and memory_share(0.5) == pytest.approx(1 / 9)
    assert memory_share(0.0) == 0.0
    for beta in (0.3, 0.5, 0.8, 0.9):  # the same share of the memory is left: beta' / (1 - beta') over m
        fast, m = compressed_momentum(beta, DELAY_STEPS * memory_share(beta)), beta / (1 - beta)
        assert fast / (1 - fast) / m == pytest.approx(4 / 9)


def test_the_shortened_momentum_gives_up_the_delay_in_steps_and_never_goes_below_zero():
    assert compressed_momentum(0.9) == pytest.approx(0.8)  # 9 steps' mean delay less 5: 4 = 0.8 / 0.2
    assert compressed_momentum(0.95) == pytest.approx(14 / 15)
    assert compressed_momentum(0.5) == 0.0 and compressed_momentum(0.0) == 0.0
    assert compressed_momentum(0.9, delay_steps=0) == pytest.approx(0.9)
    betas = [0.5, 0.8, 0.9, 0.95, 0.99]
    shortened = [compressed_momentum(b) for b in betas]
    assert shortened == sorted(shortened) and all(s < b for s, b in zip(shortened, betas))
    assert DELAY_STEPS == 5.0


def test_a_denser_payload_gives_up_less_delay_and_the_delay_is_capped():
    """log(1/rho) / log(1/DELAY_DENSITY) of DELAY_STEPS: the ramp's first density 1/8 gives up 2.26 steps
    (momentum 0.9 becomes 0.87), 1 % the whole 5 (0.8); sparser payloads keep 5; dense gives up nothing."""
    assert DELAY_DENSITY == 0.01
    assert delay_at(0.01) == pytest.approx(DELAY_STEPS) and delay_at(0.001) == DELAY_STEPS
    assert delay_at(1 / 8) == pytest.approx(5 * 3 / (2 * 2.302585 / 0.693147), rel=1e-4)
    assert compressed_momentum(0.9, delay_at(1 / 8)) == pytest.approx(0.871, abs=1e-3)
    assert delay_at(1.0) == 0.0 and delay_at(0.0) == 0.0
    delays = [delay_at(d) for d in (1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 0.01)]
    assert delays == sorted(delays)


@pytest.mark.parametrize("beta", [0.8, 0.9, 0.95])
@pytest.mark.parametrize("delay", [delay_at(1 / 8), DELAY_STEPS])
def test_below_the_peak_rate_more_delay_is_given_up_while_the_step_answers_no_harder_than_at_the_peak(beta, delay):
    """k * lr (k = (1 - beta') / (1 - beta): the step's answer to a new gradient) stays at its value at the peak
    rate as the rate falls, until the momentum is gone; at the peak the delay is the density's."""
    m = beta / (1 - beta)
    assert stable_delay(delay, beta, 1.0) == delay and stable_delay(delay, beta, 0.5) == delay

    def answer(d, lr):
        fast = compressed_momentum(beta, d)
        return (1 - fast) / (1 - beta) * lr

    at_peak = answer(delay, 1.0)
    previous = min(delay, m)
    for ratio in (1.25, 2.0, 4.0, 10.0, 100.0):
        given_up = stable_delay(delay, beta, ratio)
        assert previous <= given_up <= m
        if given_up < m:
            assert answer(given_up, 1 / ratio) == pytest.approx(at_peak)
        else:
            assert answer(given_up, 1 / ratio) <= at_peak * (1 + 1e-9) and compressed_momentum(beta, given_up) == 0
        previous = given_up
    assert stable_delay(delay, beta, 1e6) == pytest.approx(m)
    assert stable_delay(0.0, beta, 10.0) == 0.0


def test_a_compressed_step_below_the_peak_rate_takes_the_stable_delay():
    """The stage keeps each param group's highest rate (dense steps count); a compressed step at half of it
    shortens the momentum by stable_delay(..., 2), and a resumed stage keeps the peak."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    for step, lr in enumerate((0.05, 0.1, 0.08)):  # dense steps: the peak is 0.1
        optimizer.param_groups[0]["lr"] = lr
        _grads(model, step)
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 0.05
    _grads(model, 3)
    old = {p: optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()}
    stage.after_compress(names, None, TopK(0.01), 0)
    optimizer.step()
    fast = compressed_momentum(0.9, stable_delay(delay_at(0.01), 0.9, 2.0))
    assert fast < compressed_momentum(0.9)
    for p in model.parameters():
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], fast * old[p] + (1 - fast) / 0.1 * p.grad)
    saved = stage.state_dict()
    assert saved == {"delay_steps": DELAY_STEPS, "peak_lr": [0.1]}
    resumed = DelayedMomentumSGD(torch.optim.SGD(_model().parameters(), lr=0.05, momentum=0.9),
                                 _model().named_parameters())
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


SETTINGS = [dict(momentum=0.9), dict(momentum=0.9, weight_decay=1e-2), dict(momentum=0.9, nesterov=True),
            dict(momentum=0.9, dampening=0.3), dict(momentum=0.95, maximize=True, weight_decay=1e-3),
            dict(momentum=0.8)]
IDS = ["plain", "wd", "nesterov", "dampening", "maximize", "short-memory"]


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_a_compressed_step_is_torchs_sgd_with_the_short_momentum_on_the_rescaled_buffer(settings):
    """Dense steps are the optimizer's own (bitwise); a compressed step equals torch's SGD with momentum
    beta' and lr k * lr on the buffer divided by k (k = (1 - beta') / (1 - beta)), the buffer kept in the
    optimizer's units; .grad, lr and momentum are as the loop left them."""
    model, plain = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, **settings)
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, **settings)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    for step in range(3):  # dense: the stage was never told of a compressed group
        _grads(model, step), _grads(plain, step)
        stage.dense(names, None, None)
        optimizer.step(), reference.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    beta = settings["momentum"]
    fast = compressed_momentum(beta, DELAY_STEPS * memory_share(beta))  # 0.8: 20/9 of its 4 steps, not all
    k = (1 - fast) / (1 - beta)
    assert beta != 0.8 or fast == pytest.approx(16 / 25)
    short = copy.deepcopy(plain)
    short_opt = torch.optim.SGD(short.parameters(), lr=0.05 * k, **{**settings, "momentum": fast})
    for p, q in zip(plain.parameters(), short.parameters()):
        short_opt.state[q]["momentum_buffer"] = reference.state[p]["momentum_buffer"] / k
    for step in range(3, 6):
        _grads(model, step), _grads(short, step)
        seen = [p.grad for p in model.parameters()]
        kept = [g.clone() for g in seen]
        stage.after_compress(names, None, TopK(0.01), 0)
        optimizer.step(), short_opt.step()
        assert all(p.grad is g and torch.equal(g, c) for p, g, c in zip(model.parameters(), seen, kept))
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.05 and group["momentum"] == beta
    for p, q in zip(model.parameters(), short.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], k * short_opt.state[q]["momentum_buffer"],
                                   rtol=1e-5, atol=1e-6)


def _stage_after_two_steps():
    """``(model, plain, optimizer, reference, stage)``: the stage's SGD and torch's own on a copy, two steps of
    SGD each, and the third step's gradients in place."""
    model, plain = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    for step in range(2):
        _grads(model, step), _grads(plain, step)
        optimizer.step(), reference.step()
    _grads(model, 2), _grads(plain, 2)
    return model, plain, optimizer, reference, stage


def test_only_parameters_whose_group_was_compressed_take_the_short_step():
    """A group that went dense this step (a policy's choice, a group under min_numel) or went by a quantizer
    keeps SGD's own step;
    what was recorded is cleared by the step, so the next step starts from nothing."""
    model, plain, optimizer, reference, stage = _stage_after_two_steps()
    named, other = dict(model.named_parameters()), dict(plain.named_parameters())
    old = optimizer.state[named["0.bias"]]["momentum_buffer"].clone()
    stage.after_compress(["0.weight"], None, TopK(0.01), 0)
    stage.after_compress(["0.bias"], None, TopK(1 / 8), 0)  # a denser payload: less delay given up
    stage.after_compress(["2.weight"], None, ThreeBit(), 0)  # a quantizer: no delay to give up
    stage.dense(["2.bias"], None, None)
    optimizer.step(), reference.step()
    assert torch.equal(named["2.weight"], other["2.weight"]) and torch.equal(named["2.bias"], other["2.bias"])
    assert not torch.equal(named["0.weight"], other["0.weight"])
    fast = compressed_momentum(0.9, delay_at(1 / 8))
    torch.testing.assert_close(optimizer.state[named["0.bias"]]["momentum_buffer"],
                               fast * old + (1 - fast) / 0.1 * named["0.bias"].grad)
    _grads(model, 3), _grads(plain, 3)
    before = {n: p.clone() for n, p in named.items()}
    optimizer.step()
    buf = optimizer.state[named["0.weight"]]["momentum_buffer"]
    torch.testing.assert_close(named["0.weight"], before["0.weight"] - 0.05 * buf)  # SGD's own step: nothing recorded


def test_under_a_per_parameter_payload_every_parameter_of_the_group_takes_the_short_step():
    """A per-parameter top-k (the engine's default granularity) holds the group back at its base's density:
    every parameter takes the short step, those it sends whole (under ``dense_below``) too."""
    model, plain, optimizer, reference, stage = _stage_after_two_steps()
    named, other = dict(model.named_parameters()), dict(plain.named_parameters())
    old = {n: optimizer.state[p]["momentum_buffer"].clone() for n, p in named.items()}
    wrapped = PerParameter(TopK(0.01), [p.numel() for p in named.values()], dense_below=named["0.bias"].numel() + 1)
    stage.after_compress(list(named), None, wrapped, 0)
    optimizer.step(), reference.step()
    fast = compressed_momentum(0.9, delay_at(0.01))
    for name, param in named.items():
        assert not torch.equal(param, other[name]), name
        torch.testing.assert_close(optimizer.state[param]["momentum_buffer"],
                                   fast * old[name] + (1 - fast) / 0.1 * param.grad)
    assert any(part.dense for part in wrapped.parts) and not all(part.dense for part in wrapped.parts)


def test_its_checkpoint_state_is_its_setting_and_another_is_refused_before_anything_changes():
    model = _model()
    stage = DelayedMomentumSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    state = stage.state_dict()
    assert state == {"delay_steps": DELAY_STEPS, "peak_lr": []}
    stage.load_state_dict(state)
    stage.load_state_dict({"delay_steps": DELAY_STEPS})  # saved before the stage kept its peaks
    with pytest.raises(ValueError, match="delay_steps"):
        stage.prepare_load({"delay_steps": 2.0})
    for peaks in ([-0.1], "0.1", [1]):
        with pytest.raises(ValueError, match="peak learning rates"):
            stage.prepare_load({"delay_steps": DELAY_STEPS, "peak_lr": peaks})
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        DelayedMomentumSGD(torch.optim.Adam(model.parameters()), model.named_parameters())
    with pytest.raises(ValueError, match="delay_steps"):
        DelayedMomentumSGD(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
                           delay_steps=-1)


def test_a_step_with_a_closure_runs_the_stage_on_the_closures_gradients():
    model, plain = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    x = torch.randn(4, 6)

    def closure_of(net, opt):
        def closure():
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            return loss
        return closure

    for _ in range(2):
        optimizer.step(closure_of(model, optimizer)), reference.step(closure_of(plain, reference))
    stage.after_compress([n for n, _ in model.named_parameters()], None, TopK(0.01), 0)
    optimizer.step(closure_of(model, optimizer)), reference.step(closure_of(plain, reference))
    fast, beta = compressed_momentum(0.9), 0.9
    k = (1 - fast) / (1 - beta)
    for p, q in zip(model.parameters(), plain.parameters()):  # the same gradient, the short momentum on it
        old = (reference.state[q]["momentum_buffer"] - q.grad) / beta
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], fast * old + k * q.grad, rtol=1e-5,
                                   atol=1e-6)


def _one_by_one(params, optimizer, group, delays):
    """The stage's update written per parameter (``delays``: each parameter's delay given up, 0: SGD's own step
    left to the optimizer): the reference of the multi-tensor step."""
    beta = group["momentum"]
    for param, delay in zip(params, delays):
        if delay <= 0:
            continue
        fast = compressed_momentum(beta, delay)
        k = (1 - fast) / (1 - beta)
        d = param.grad.neg() if group["maximize"] else param.grad.clone()
        if group["weight_decay"]:
            d.add_(param, alpha=group["weight_decay"])
        state = optimizer.state[param]
        if state.get("momentum_buffer") is None:
            state["momentum_buffer"] = d.mul(k)
        else:
            state["momentum_buffer"].mul_(fast).add_(d, alpha=k * (1 - group["dampening"]))
        buf = state["momentum_buffer"]
        param.data.add_(d.mul_(k).add_(buf, alpha=fast) if group["nesterov"] else buf, alpha=-group["lr"])
        param.grad = None  # the optimizer's own step leaves it alone


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_the_multi_tensor_step_is_bitwise_the_step_taken_one_parameter_at_a_time(settings):
    """Parameters held back alike step together (torch's _foreach ops); held back at other densities, with a
    buffer or starting one, the result is bit for bit the per-parameter arithmetic."""
    model, twin = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, **settings)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, **settings)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    densities = [0.01, 1 / 8, 0.01, None]  # 2.bias goes dense: SGD's own step, which starts its buffer
    for step in range(3):
        _grads(model, step), _grads(twin, step)
        for name, density in zip(names, densities):
            if density is None or (step == 0 and name == "0.bias"):  # 0.bias starts its buffer on a dense step
                stage.dense([name], None, None)
            else:
                stage.after_compress([name], None, TopK(density), 0)
        optimizer.step()
        share = memory_share(settings["momentum"])
        delays = [0.0 if d is None or (step == 0 and n == "0.bias") else delay_at(d) * share
                  for n, d in zip(names, densities)]
        _one_by_one(list(twin.parameters()), twin_opt, twin_opt.param_groups[0], delays)
        twin_opt.step()  # the parameters the reference left to SGD's own step
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["momentum_buffer"], twin_opt.state[q]["momentum_buffer"])
