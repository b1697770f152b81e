"""The caught-up frozen Adam step in one pass (gradcomp.backends.numba.caught_up_step): bitwise torch's ops, declined
where it cannot be, and the stage's top-k runs the same bits with it and without."""
import pytest
import torch

import gradcomp.optim.frozen_update as frozen_update_module
from gradcomp.backends import form_kernel
from gradcomp.backends.numba import caught_up_step
from gradcomp.compressors import TopK
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.catch_up import share_table

CPU = torch.device("cpu")
SIZES = list(range(1, 45)) + [1000, 4099, 65543]
SHARES = share_table(0.9, CPU)


def tensors(sizes, seed, density=0.3):
    generator = torch.Generator().manual_seed(seed)
    return ([torch.randn(n, generator=generator) for n in sizes],
            [torch.randn(n, generator=generator) * 1e-3 for n in sizes],
            [torch.randn(n, generator=generator) * (torch.rand(n, generator=generator) < density) for n in sizes],
            [torch.rand(n, generator=generator) * 1e-2 + 1e-8 for n in sizes],
            [torch.randint(0, 3000, (n,), generator=generator, dtype=torch.int16) for n in sizes])


def both(sizes, seed, factor, weight, decay):
    """(the form's params, moments and waits, torch's) after one step from the same tensors; the form's verdict."""
    params, moments, grads, denoms, waits = tensors(sizes, seed)
    values = [-3e-4 / (1 - 0.9 ** (3 + i % 50)) for i in range(len(sizes))]
    expected = [[t.clone() for t in group] for group in (params, moments, waits)]
    caught_up_step.torch_form(expected[0], expected[1], grads, denoms, expected[2], SHARES, factor, weight, decay,
                              values)
    done = form_kernel("elementwise", "caught_up_step", CPU, "numba")(params, moments, grads, denoms, waits, SHARES,
                                                                      factor, weight, decay, values)
    return [params, moments, waits], expected, done


@pytest.mark.parametrize("factor,weight,decay", [
    (None, 0.1, None), (torch.tensor(0.8731), 0.1, 1 - 3e-5), (torch.tensor(1.7), 0.5, None),
    (None, 0.6, 0.9999), (torch.tensor(0.25), 0.999, 1 - 1e-4)])
def test_the_one_pass_step_is_torchs_bit_for_bit(factor, weight, decay):
    got, expected, done = both(SIZES, 1, factor, weight, decay)
    assert done
    for mine, theirs in zip(got, expected):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
    assert any(bool((w == 0).any()) and bool((w > 1).any()) for w in got[2])  # waits both ended and grew


def test_non_finite_gradients_step_as_torch_steps_them():
    params, moments, grads, denoms, waits = tensors([20, 9], seed=2)
    grads[0][3], grads[0][11], grads[1][0] = float("nan"), float("inf"), -float("inf")
    expected = [[t.clone() for t in group] for group in (params, moments, waits)]
    caught_up_step.torch_form(expected[0], expected[1], grads, denoms, expected[2], SHARES, torch.tensor(0.5), 0.1,
                              0.99, [-1e-3, -2e-3])
    assert form_kernel("elementwise", "caught_up_step", CPU, "numba")(params, moments, grads, denoms, waits, SHARES,
                                                                      torch.tensor(0.5), 0.1, 0.99, [-1e-3, -2e-3])
    for mine, theirs in zip([params, moments, waits], expected):
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_form_declines_what_it_cannot_promise_and_writes_nothing():
    fused = form_kernel("elementwise", "caught_up_step", CPU, "numba")
    params, moments, grads, denoms, waits = tensors([12, 30], seed=3)
    kept = [t.clone() for t in params + moments + waits]
    values = [-1e-3, -1e-3]
    step = lambda *args, shares=SHARES: fused(*args, shares, None, 0.1, None, values)  # noqa: E731
    assert not step([p.double() for p in params], moments, grads, denoms, waits)
    assert not step(params, moments, grads, denoms, [w.int() for w in waits])  # int16 waits only
    assert not step(params, moments, grads, [torch.rand(24)[::2]] + denoms[1:], waits)  # not contiguous
    assert not step(params, moments, grads, denoms[::-1], waits)  # sizes differ
    assert not step(params, moments, moments, denoms, waits)  # the gradients are the moments it writes
    assert not step(params, moments, grads, denoms, waits, shares=torch.cat([SHARES, SHARES]))  # past int16
    assert not step(params, moments, grads, denoms, waits, shares=SHARES.double())
    for outside in (1.5, -0.25, float("nan")):  # where g is zero the kernel reads shares[0], sound for [0, 1] only
        shares = SHARES.clone()
        shares[7] = outside
        assert not step(params, moments, grads, denoms, waits, shares=shares)
    assert not fused(params, moments, grads, denoms, waits, SHARES, None, 0.1, None, values[:1])
    assert all(torch.equal(a, b) for a, b in zip(params + moments + waits, kept))


def run(weight_decay, steps=30):
    """A small net, two param groups, frozen at step 8, then top-k's sparse averages (every third coordinate
    shifting); its parameters at the end."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 37), torch.nn.Tanh(), torch.nn.Linear(37, 3))
    optimizer = torch.optim.AdamW([{"params": net[0].parameters()}, {"params": net[2].parameters(), "lr": 3e-3}],
                                  lr=1e-2, weight_decay=weight_decay)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=8, spike_guard=False)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        optimizer.zero_grad()
        net(batch).square().sum().backward()
        if step >= 8:
            for p in net.parameters():
                p.grad.mul_((torch.arange(p.numel()) % 3 == step % 3).view(p.shape))
            stage.after_compress([n for n, _ in net.named_parameters()], None, TopK(0.01), 0)
        optimizer.step()
    return [p.detach().clone() for p in net.parameters()], {k: w.clone() for k, w in stage.catch_up.waits.items()}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_stages_caught_up_steps_are_bitwise_those_of_torchs_ops(monkeypatch, weight_decay):
    """Every caught-up step of both groups in one pass, and the same parameters and waits as torch's ops make."""
    calls = []
    real = frozen_update_module.form_kernel

    def counted(family, op, *args, **kwargs):
        fused = real(family, op, *args, **kwargs)
        return (lambda *a: fused(*a) and not calls.append(1)) if op == "caught_up_step" else fused

    monkeypatch.setattr(frozen_update_module, "form_kernel", counted)
    params, waits = run(weight_decay)
    assert len(calls) == 44  # 22 frozen steps, two groups each
    assert any(bool((w > 0).any()) for w in waits.values())
    monkeypatch.setattr(frozen_update_module, "form_kernel", lambda *args, **kwargs: None)
    torch_params, torch_waits = run(weight_decay)
    assert all(torch.equal(a, b) for a, b in zip(params, torch_params))
    assert waits.keys() == torch_waits.keys() and all(torch.equal(waits[k], torch_waits[k]) for k in waits)


def test_a_wait_at_the_tables_end_stays_there():
    """The stage clamps waits far below the table's end (catch_up.MAX_WAIT); one there anyway reads the last share
    and stays (no read past the table, no int16 overflow), where torch's index_select would refuse it."""
    params, moments, grads, denoms, waits = tensors([6], seed=5, density=0.0)
    waits[0].fill_(SHARES.numel() - 1)
    grads[0][2] = 1.0
    assert form_kernel("elementwise", "caught_up_step", CPU, "numba")(params, moments, grads, denoms, waits, SHARES,
                                                                      None, 0.1, None, [-1e-3])
    assert waits[0].tolist() == [SHARES.numel() - 1] * 2 + [0] + [SHARES.numel() - 1] * 3
