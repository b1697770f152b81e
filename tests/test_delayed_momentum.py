"""DelayedMomentumSGD: SGD-momentum's stage under a sparsifier (gradcomp.optim.delayed_momentum).

In-process: a coordinate sent every step takes torch's own SGD step; a burst after a wait lands where dense
SGD-momentum would have put the same gradients on time; the update against the docstring's formula written one
element at a time in float64. The recipe's choice of the stage, and its run on real Gloo ranks, are in
test_recipe.py."""
import pytest
import torch

from gradcomp.compressors import ThreeBit, TopK
from gradcomp.optim import DelayedMomentumSGD
from gradcomp.optim.catch_up import MAX_WAIT

SETTINGS = [dict(momentum=0.9), dict(momentum=0.9, weight_decay=1e-2), dict(momentum=0.9, nesterov=True),
            dict(momentum=0.9, dampening=0.3), dict(momentum=0.95, maximize=True, weight_decay=1e-3),
            dict(momentum=0.8)]
IDS = ["plain", "wd", "nesterov", "dampening", "maximize", "short-memory"]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _grads(model, step, keep=1.0):
    """Random gradients; ``keep`` < 1 zeroes the rest, as a sparse average leaves them."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * (torch.rand(p.shape, generator=gen) < keep)


def _compressed(stage, model):
    stage.after_compress([n for n, _ in model.named_parameters()], None, TopK(0.01), 0)


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_a_coordinate_sent_every_step_takes_torchs_own_sgd_step(settings):
    """Dense steps are the optimizer's own; compressed steps whose average is nonzero everywhere (every wait 1)
    are torch's SGD step too, bit for bit; .grad, lr and momentum are as the loop left them."""
    model, plain = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, **settings)
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, **settings)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    for step in range(6):
        _grads(model, step), _grads(plain, step)
        seen = [p.grad for p in model.parameters()]
        kept = [g.clone() for g in seen]
        if step >= 2:
            _compressed(stage, model)
        optimizer.step(), reference.step()
        assert all(p.grad is g and torch.equal(g, c) for p, g, c in zip(model.parameters(), seen, kept))
        assert all(not bool(w.any()) for w in stage.catch_up.waits.values())
    assert set(stage.catch_up.waits) == {n for n, _ in model.named_parameters()}
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.05 and group["momentum"] == settings["momentum"]
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"])


@pytest.mark.parametrize("settings", [s for s in SETTINGS if not s.get("weight_decay")],
                         ids=[i for i, s in zip(IDS, SETTINGS) if not s.get("weight_decay")])
@pytest.mark.parametrize("wait", [2, 5, 40])
def test_a_burst_after_a_wait_lands_where_dense_momentum_would_have_put_the_same_gradients(settings, wait):
    """A coordinate whose average is zero for ``wait - 1`` steps and then ``wait * g`` ends that step at dense
    SGD-momentum's parameter and buffer after ``wait`` steps of ``g`` (the same momentum carried in); a coordinate
    sent every step beside it is dense's throughout."""
    p = torch.nn.Parameter(torch.tensor([0.3, -0.2]))
    q = torch.nn.Parameter(p.detach().clone())
    optimizer, reference = (torch.optim.SGD([x], lr=0.05, **settings) for x in (p, q))
    stage = DelayedMomentumSGD(optimizer, [("w", p)])
    g = torch.tensor([0.7, -1.3])
    for step in range(2):  # dense steps: a buffer to carry in
        p.grad, q.grad = g * (step + 1), g * (step + 1)
        optimizer.step(), reference.step()
    for step in range(1, wait + 1):
        p.grad = torch.stack([g[0], g[1] * wait if step == wait else torch.tensor(0.0)])
        q.grad = g.clone()
        stage.after_compress(["w"], None, TopK(0.01), 0)
        optimizer.step(), reference.step()
        if step < wait:
            assert stage.catch_up.waits["w"].tolist() == [0, step]
            torch.testing.assert_close(p[0], q[0])
    assert stage.catch_up.waits["w"].tolist() == [0, 0]
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"],
                               rtol=1e-5, atol=1e-6)


def _formula(p, buf, r, a, group):
    """The module docstring's update of one parameter in float64 (``r``: the average; ``a``: the waits + 1);
    returns the new parameter and buffer."""
    beta, lr, damped = group["momentum"], group["lr"], 1 - group["dampening"]
    r = -r if group["maximize"] else r
    c = (1 - beta ** a) / ((1 - beta) * a)
    d = c * r + group["weight_decay"] * p
    buf = d.clone() if buf is None else beta * buf + damped * d
    step = d + beta * buf if group["nesterov"] else buf
    return p - lr * step - lr * damped * (1 - c) / (1 - beta) * r, buf


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_the_multi_tensor_step_is_the_formula_one_element_at_a_time(settings):
    """Sparse averages (a third of each parameter nonzero a step), a quantized and a dense group beside them:
    every compressed parameter follows the formula with its own waits, the others torch's own step."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, **settings)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    group = optimizer.param_groups[0]
    named = dict(model.named_parameters())
    twin = {n: (p.detach().double().clone(), None) for n, p in named.items()}
    counts = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in named.items()}
    for step in range(8):
        _grads(model, step, keep=1 / 3)
        for name, param in named.items():
            if name == "2.bias" or (name == "0.bias" and step == 0):  # dense: SGD's own step, its buffer started
                stage.dense([name], None, None)
                counts[name].zero_()
                twin[name] = _formula(twin[name][0], twin[name][1], param.grad.double(), 1.0, group)
            else:
                stage.after_compress([name], None, ThreeBit() if name == "2.weight" else TopK(0.1), 0)
                a = counts[name] + 1 if name != "2.weight" else torch.ones_like(counts[name])
                twin[name] = _formula(twin[name][0], twin[name][1], param.grad.double(), a, group)
                counts[name] = torch.where(param.grad != 0, torch.zeros_like(a), a)
        optimizer.step()
        assert set(stage.catch_up.waits) == ({"0.weight", "0.bias"} if step > 0 else {"0.weight"})  # not a quantizer's
    for name, param in named.items():
        torch.testing.assert_close(param.double(), twin[name][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(optimizer.state[param]["momentum_buffer"].double(), twin[name][1], rtol=1e-5,
                                   atol=1e-6)
        if name in stage.catch_up.waits:
            assert torch.equal(stage.catch_up.waits[name].double(), counts[name]), name


def test_a_wait_saturates_at_max_wait_and_a_long_burst_is_applied_as_plain_sgd_at_lr_over_one_minus_beta():
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    stage = DelayedMomentumSGD(optimizer, [("w", p)])
    optimizer.state[p]["momentum_buffer"] = torch.zeros(1)
    stage.catch_up.waits["w"] = torch.full((1,), MAX_WAIT, dtype=torch.int16)
    p.grad = torch.ones(1)
    stage.after_compress(["w"], None, TopK(0.01), 0)
    optimizer.step()
    # c = 10 / MAX_WAIT: the buffer takes almost nothing, the parameter moves by almost lr / (1 - beta)
    torch.testing.assert_close(p, torch.tensor([-1.0]), rtol=1e-3, atol=0)
    assert stage.catch_up.waits["w"].tolist() == [0] and stage.catch_up.waits["w"].dtype == torch.int16


def test_a_step_with_a_closure_runs_the_stage_on_the_closures_gradients():
    model, plain = _model(), _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    reference = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    stage = DelayedMomentumSGD(optimizer, model.named_parameters())
    stage.catch_up.waits = {n: torch.full(p.shape, 3, dtype=torch.int16) for n, p in model.named_parameters()}
    x = torch.randn(4, 6)

    def closure_of(net, opt):
        def closure():
            opt.zero_grad()
            loss = net(x).square().mean()
            loss.backward()
            return loss
        return closure

    _compressed(stage, model)
    optimizer.step(closure_of(model, optimizer)), reference.step(closure_of(plain, reference))
    c = (1 - 0.9 ** 4) / (0.1 * 4)  # every coordinate waited 3 steps: a = 4
    for p, q in zip(model.parameters(), plain.parameters()):  # the closure's gradient, caught up
        torch.testing.assert_close(optimizer.state[p]["momentum_buffer"], c * q.grad, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p, q + 0.05 * q.grad - 0.05 * (c + (1 - c) / 0.1) * q.grad, rtol=1e-5, atol=1e-7)


def test_its_checkpoint_is_its_waits_and_a_resumed_stage_steps_as_the_uninterrupted_one():
    """state_dict holds the waits (int16, CPU); a stage loaded from it steps bit for bit as the one that went on; a
    state saved before the stage kept waits loads with none; a state that does not fit is refused before
    anything changes."""
    runs = []
    for resume in (False, True):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        stage = DelayedMomentumSGD(optimizer, model.named_parameters())
        for step in range(6):
            if resume and step == 3:
                saved, opt_state = stage.state_dict(), optimizer.state_dict()
                assert all(w.dtype == torch.int16 and w.device.type == "cpu" for w in saved["waits"].values())
                assert any(bool(w.any()) for w in saved["waits"].values())
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                optimizer.load_state_dict(opt_state)
                stage = DelayedMomentumSGD(optimizer, model.named_parameters())
                stage.load_state_dict(saved)
            _grads(model, step, keep=0.3)
            _compressed(stage, model)
            optimizer.step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    stage.load_state_dict({"delay_steps": 5.0, "peak_lr": [0.05]})
    assert stage.catch_up.waits == {}
    stage.catch_up.waits = {"0.bias": torch.ones(5, dtype=torch.int16)}
    for bad in ({"waits": {"nope": torch.zeros(5, dtype=torch.int16)}}, {"waits": {"0.bias": torch.zeros(4)}},
                {"waits": {"0.bias": torch.full((5,), -1, dtype=torch.int16)}}, {"waits": {}, "extra": 1}, [1]):
        with pytest.raises(ValueError, match="checkpoint"):
            stage.prepare_load(bad)
        assert list(stage.catch_up.waits) == ["0.bias"] and stage.catch_up.waits["0.bias"].tolist() == [1] * 5
    stage.reset()
    assert stage.catch_up.waits == {}
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        DelayedMomentumSGD(torch.optim.Adam(model.parameters()), model.named_parameters())
