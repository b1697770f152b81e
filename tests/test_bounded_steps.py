"""FrozenVarianceAdam's bound: a frozen step whose root mean square (in update units) passes 1 is scaled back."""
import math

import pytest
import torch

import gradcomp
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.frozen_update import bounded_step


def test_the_divisor_is_the_root_mean_square_where_it_passes_one_else_exactly_one():
    assert float(bounded_step(torch.full((4,), 3.0))) == pytest.approx(3.0)
    assert float(bounded_step(torch.full((4,), 3.0), bias=0.5)) == pytest.approx(6.0)
    small = torch.tensor([0.5, -0.9, 0.1])
    assert torch.equal(small / bounded_step(small), small)  # bitwise a no-op where the bound holds
    assert float(bounded_step(torch.zeros(0))) == 1.0


def frozen_on_small_gradients(exchange, bounded):
    """A net whose variance froze at step 10 while its gradients were 1000 times smaller than the next ones."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.0)
    stage = FrozenVarianceAdam(optimizer, net.named_parameters(), freeze_step=10, exchange=exchange, bounded=bounded)
    generator = torch.Generator().manual_seed(1)
    for _ in range(10):
        optimizer.zero_grad()
        net(1e-3 * torch.randn(4, 6, generator=generator)).square().sum().backward()
        optimizer.step()
    return net, optimizer, stage


def rms(tensor):
    return float(tensor.norm()) / math.sqrt(tensor.numel())


@pytest.mark.parametrize("bounded", [True, False])
def test_a_frozen_gradient_step_of_a_stale_variance_is_scaled_back_to_root_mean_square_one(bounded):
    net, optimizer, _ = frozen_on_small_gradients("gradient", bounded)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.zero_grad()
    net(torch.randn(4, 6)).square().sum().backward()
    given = [p.grad.clone() for p in net.parameters()]
    optimizer.step()
    steps = [rms(p.detach() - b) / 1e-3 for p, b in zip(net.parameters(), before)]
    if bounded:  # the first layer's variance is stale: its step is scaled back to 1, the others' kept below it
        assert steps[0] == pytest.approx(1.0, rel=1e-4) and max(steps) <= 1 + 1e-4
    else:
        assert steps[0] > 100
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), given))  # .grad as the loop left it


@pytest.mark.parametrize("bounded", [True, False])
def test_what_a_rank_compresses_takes_a_step_share_of_root_mean_square_one_at_most(bounded):
    """Momentum exchange: each step adds at most root mean square 1 per parameter to what a rank compresses
    (its direction kept); the rank's first moment itself (its state) is not scaled."""
    net, optimizer, stage = frozen_on_small_gradients("momentum", bounded)
    keys = [n for n, _ in net.named_parameters()]
    numels = [p.numel() for p in net.parameters()]
    grad = torch.linspace(-1, 1, sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    sent = stage.before_compress(keys, numels, grad, gradcomp.TopK(0.01))
    stage.commit(keys)
    moment = torch.lerp(start, grad, 1 - 0.8)
    torch.testing.assert_close(torch.cat([stage.moments[k] for k in keys]), moment)
    denoms = torch.cat([optimizer.state[p]["frozen_denom"].reshape(-1) for p in net.parameters()])
    wholes = (moment / denoms).split(numels)
    assert max(rms(w) for w in wholes) > 100 and min(rms(w) for w in wholes) < 1
    for piece, whole in zip(sent.split(numels), wholes):
        if bounded and rms(whole) > 1:
            assert rms(piece) == pytest.approx(1.0, rel=1e-5)
            torch.testing.assert_close(piece, whole / rms(whole), rtol=1e-5, atol=0)
        else:
            assert torch.equal(piece, whole)


@pytest.mark.parametrize("exchange", ["gradient", "momentum"])
def test_where_the_bound_holds_the_step_is_bitwise_the_unbounded_one(exchange):
    """Gradients of the scale the variance froze on: bounded and unbounded stages move alike, bit for bit."""
    nets = []
    for bounded in (True, False):
        net, optimizer, stage = frozen_on_small_gradients(exchange, bounded)
        keys = [n for n, _ in net.named_parameters()]
        numels = [p.numel() for p in net.parameters()]
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            optimizer.zero_grad()
            net(1e-4 * torch.randn(4, 6, generator=generator)).square().sum().backward()
            grad = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            sent = stage.before_compress(keys, numels, grad, gradcomp.TopK(0.01))
            assert max(rms(piece) for piece in sent.split(numels)) < 1
            stage.commit(keys)
            stage.after_average(keys, numels, sent, dense=False)
            for p, piece in zip(net.parameters(), sent.split(numels)):
                p.grad = piece.reshape(p.shape)
            optimizer.step()
        nets.append(net)
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
