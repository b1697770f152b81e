"""The stage's gradient norms in one pass: bitwise torch's, and the stage's steps bitwise those on torch's norms."""
import torch

import gradcomp.optim.step_norms as step_norms_module
from gradcomp.backends import form_kernel
from gradcomp.backends.numba import norms
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.step_norms import step_norms

CPU = torch.device("cpu")


def tensors(sizes, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=generator) * scale * 10.0 ** (i % 7 - 3) for i, n in enumerate(sizes)]
    denoms = [torch.rand(n, generator=generator) * 10.0 ** (i % 3 - 1) + 1e-8 for i, n in enumerate(sizes)]
    return grads, denoms


def assert_bitwise(got, expected):
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_numba_form_is_torchs_norms_bit_for_bit_at_every_tail_length():
    fused = form_kernel("elementwise", "quotient_norms", CPU, "numba")
    sizes = list(range(0, 70)) + [1000, 4099, 65543, 100_000]
    for seed, scale in ((0, 1.0), (1, 1e-19), (2, 1e18)):  # subnormal squares, squares that overflow to inf
        grads, denoms = tensors(sizes, seed, scale)
        got = fused(grads, denoms)
        assert got is not None and norms._reduction[0] is not None  # torch's reduction here is one the form knows
        assert_bitwise(got, norms._torch_form(grads, denoms))
    shaped = [torch.randn(64, 33), torch.randn(3, 5, 7), torch.randn(96, 384)]
    divisors = [torch.rand(t.shape) + 0.5 for t in shaped]
    assert_bitwise(fused(shaped, divisors), norms._torch_form(shaped, divisors))


def test_non_finite_values_and_zero_denominators_give_torchs_values():
    grads = [torch.tensor([1.0, float("nan"), 2.0] * 5), torch.tensor([float("inf")] + [1.0] * 20),
             torch.tensor([3.0] * 9), torch.zeros(17)]
    denoms = [torch.ones(15), torch.ones(21), torch.tensor([1.0] * 8 + [0.0]), torch.zeros(17)]
    got = form_kernel("elementwise", "quotient_norms", CPU, "numba")(grads, denoms)
    assert_bitwise(got, norms._torch_form(grads, denoms))
    assert torch.isnan(got[0][0]) and torch.isinf(got[0][1]) and torch.isinf(got[0][2]) and torch.isnan(got[0][3])


def test_the_form_declines_what_it_cannot_promise_and_mutates_nothing():
    fused = form_kernel("elementwise", "quotient_norms", CPU, "numba")
    grads, denoms = tensors([10, 20], seed=3)
    kept = [g.clone() for g in grads] + [d.clone() for d in denoms]
    assert fused([g.double() for g in grads], [d.double() for d in denoms]) is None
    assert fused([g.half() for g in grads], denoms) is None
    assert fused([torch.randn(4, 6).t()], [torch.rand(6, 4) + 1]) is None  # not contiguous
    assert fused(grads, denoms[::-1]) is None  # a denominator of another size
    assert fused(grads, denoms[:1]) is None
    fused(grads, denoms)
    assert all(torch.equal(a, b) for a, b in zip(grads + denoms, kept))


def test_step_norms_gives_torchs_norms_with_the_form_and_without(monkeypatch):
    grads, denoms = tensors([5, 130, 7], seed=4)
    expected = norms._torch_form(grads, denoms)
    assert_bitwise(step_norms(grads, denoms, plain=True), expected)
    quotients, plain = step_norms(grads, denoms, plain=False)
    assert plain is None and torch.equal(quotients, expected[0])
    monkeypatch.setattr(step_norms_module, "form_kernel", lambda *args, **kwargs: None)
    assert_bitwise(step_norms(grads, denoms, plain=True), expected)


def run(steps=40, spike_at=25):
    """A small net under AdamW, two param groups, frozen at step 10 (the guard and the live level on), a jump in
    ``.grad`` at ``spike_at``; its parameters at the end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 37), torch.nn.Tanh(), torch.nn.Linear(37, 3))
    optimizer = torch.optim.AdamW([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 3e-3}],
                                  lr=1e-2)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        optimizer.zero_grad()
        net(batch).square().sum().backward()
        if step == spike_at:
            for p in net.parameters():
                p.grad.mul_(30.0)
        optimizer.step()
    assert stage.level is not None and stage.guard.observed > 0
    return [p.detach().clone() for p in net.parameters()]


def test_the_stages_steps_are_bitwise_those_on_torchs_norms(monkeypatch):
    calls = []
    real = step_norms_module.form_kernel

    def counted(*args, **kwargs):
        fused = real(*args, **kwargs)
        return None if fused is None else lambda *a: calls.append(1) or fused(*a)

    monkeypatch.setattr(step_norms_module, "form_kernel", counted)
    with_form = run()
    assert len(calls) == 39  # every step after the first (Adam has no variance to divide by before it)
    monkeypatch.setattr(step_norms_module, "form_kernel", lambda *args, **kwargs: None)
    assert all(torch.equal(a, b) for a, b in zip(with_form, run()))


def test_the_probes_tell_the_candidate_orders_apart():
    """Only the order found for this build gives torch's bits: a wrong lane width or tail gives others."""
    grads, denoms = tensors(list(range(1, 40)) + [4099], seed=5)
    expected = form_kernel("elementwise", "quotient_norms", CPU, "numba")(grads, denoms)
    for candidate in norms.CANDIDATES:
        got = norms._run(norms._table(grads, denoms), *candidate)
        assert all(torch.equal(a, b) for a, b in zip(got, expected)) == (candidate == norms._reduction[0])
