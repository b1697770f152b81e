"""The frozen-variance Adam step in one pass: bitwise torch's multi-tensor ops, declined where it cannot be, and the
stage's runs the same bits with it and without."""
import pytest
import torch

import gradcomp.optim.frozen_update as frozen_update_module
import gradcomp.optim.step_norms as step_norms_module
from gradcomp.backends import form_kernel
from gradcomp.backends.numba import frozen_step
from gradcomp.optim import FrozenVarianceAdam

CPU = torch.device("cpu")
SIZES = list(range(0, 45)) + [1000, 4099, 65543]


def tensors(sizes, seed):
    generator = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, generator=generator) for n in sizes],
            [torch.randn(n, generator=generator) * 1e-3 for n in sizes],
            [torch.randn(n, generator=generator) * 1e-2 for n in sizes],
            [torch.rand(n, generator=generator) * 1e-2 + 1e-8 for n in sizes])


def both(sizes, seed, factor, weight, copy, decay):
    """(the form's params and moments, torch's) after one step from the same tensors; the form's verdict."""
    params, moments, grads, denoms = tensors(sizes, seed)
    values = [-3e-4 / (1 - 0.9 ** (3 + i % 50)) for i in range(len(sizes))]
    expected = [[t.clone() for t in params], [t.clone() for t in moments]]
    frozen_step._torch_form(*expected, grads, denoms, factor, weight, copy, decay, values)
    done = form_kernel("elementwise", "frozen_step", CPU, "numba")(params, moments, grads, denoms, factor, weight,
                                                                     copy, decay, values)
    return [params, moments], expected, done


@pytest.mark.parametrize("factor,weight,copy,decay", [
    (None, 0.1, False, None), (torch.tensor(0.8731), 0.1, False, 1 - 3e-5), (torch.tensor(1.7), 0.5, False, None),
    (None, 0.6, False, 0.9999), (torch.tensor(0.25), 0.999, False, 1 - 1e-4), (torch.tensor(0.3), 0.1, True, 0.999),
    (None, 0.2, True, None)])
def test_the_one_pass_step_is_torchs_bit_for_bit(factor, weight, copy, decay):
    got, expected, done = both([n for n in SIZES if n], 1, factor, weight, copy, decay)
    assert done
    for mine, theirs in zip(got, expected):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))


def test_non_finite_gradients_step_as_torch_steps_them():
    params, moments, grads, denoms = tensors([20, 9], seed=2)
    grads[0][3], grads[0][11], grads[1][0] = float("nan"), float("inf"), -float("inf")
    denoms[1][4] = 0.0
    expected = [[t.clone() for t in params], [t.clone() for t in moments]]
    frozen_step._torch_form(*expected, grads, denoms, torch.tensor(0.5), 0.1, False, 0.99, [-1e-3, -2e-3])
    assert form_kernel("elementwise", "frozen_step", CPU, "numba")(params, moments, grads, denoms, torch.tensor(0.5),
                                                                   0.1, False, 0.99, [-1e-3, -2e-3])
    for mine, theirs in zip([params, moments], expected):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_form_declines_what_it_cannot_promise_and_writes_nothing():
    fused = form_kernel("elementwise", "frozen_step", CPU, "numba")
    params, moments, grads, denoms = tensors([12, 30], seed=3)
    kept = [t.clone() for t in params + moments]
    values = [-1e-3, -1e-3]
    step = lambda *args: fused(*args, None, 0.1, False, None, values)  # noqa: E731
    assert not step([p.double() for p in params], moments, grads, denoms)
    assert not step(params, moments, [g.half() for g in grads], denoms)
    assert not step(params, moments, grads, [torch.rand(24)[::2]] + denoms[1:])  # not contiguous
    assert not step(params, moments, grads, denoms[::-1])  # sizes differ
    assert not step(params, moments, moments, denoms)  # the gradients are the moments it writes
    assert not step(params, params, grads, denoms)
    assert not fused(params, moments, grads, denoms, None, 0.1, False, None, values[:1])
    assert not fused(params, moments, grads, denoms, torch.tensor(0.5, dtype=torch.float64), 0.1, False, None, values)
    assert all(torch.equal(a, b) for a, b in zip(params + moments, kept))


def test_a_step_counts_as_an_in_place_write_for_autograd():
    params, moments, grads, denoms = tensors([8], seed=4)
    before = params[0]._version, moments[0]._version
    assert form_kernel("elementwise", "frozen_step", CPU, "numba")(params, moments, grads, denoms, None, 0.1, False,
                                                                   None, [-1e-3])
    assert params[0]._version > before[0] and moments[0]._version > before[1]


def run(optimizer_class, exchange, weight_decay, steps=30):
    """A small net, two param groups, frozen at step 8, a jump in ``.grad`` at step 20; its parameters at the end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 37), torch.nn.Tanh(), torch.nn.Linear(37, 3))
    optimizer = optimizer_class([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 3e-3}],
                                lr=1e-2, weight_decay=weight_decay)
    FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=8, exchange=exchange)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        optimizer.zero_grad()
        net(batch).square().sum().backward()
        if step == 20:
            for p in net.parameters():
                p.grad.mul_(30.0)
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("optimizer_class,exchange,weight_decay,fused_steps", [
    (torch.optim.AdamW, "gradient", 0.1, 44), (torch.optim.AdamW, "momentum", 0.01, 44),
    (torch.optim.Adam, "gradient", 0.0, 44), (torch.optim.Adam, "gradient", 0.1, 0)])
def test_the_stages_steps_are_bitwise_those_of_torchs_ops(monkeypatch, optimizer_class, exchange, weight_decay,
                                                           fused_steps):
    """Every frozen step of both groups in one pass (Adam's L2 decay, which joins the gradient, stays in torch's ops),
    and the same parameters as torch's ops make."""
    calls = []
    real = frozen_update_module.form_kernel

    def counted(*args, **kwargs):
        fused = real(*args, **kwargs)
        return lambda *a: fused(*a) and not calls.append(1)

    monkeypatch.setattr(frozen_update_module, "form_kernel", counted)
    with_form = run(optimizer_class, exchange, weight_decay)
    assert len(calls) == fused_steps  # 22 frozen steps, two groups each
    monkeypatch.setattr(frozen_update_module, "form_kernel", lambda *args, **kwargs: None)
    monkeypatch.setattr(step_norms_module, "form_kernel", lambda *args, **kwargs: None)
    assert all(torch.equal(a, b) for a, b in zip(with_form, run(optimizer_class, exchange, weight_decay)))
