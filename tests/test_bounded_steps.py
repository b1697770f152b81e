"""FrozenVarianceAdam's bound: no frozen step moves a coordinate farther than the user's Adam could."""
import pytest
import torch

import gradcomp
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.optim.frozen_adam import adam_step_bound


def adam_steps(gradients, betas):
    """The steps, in learning rates, torch's own Adam takes on a scalar fed ``gradients`` (float64)."""
    param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=1.0, betas=betas, eps=0.0)
    steps = []
    for g in gradients:
        before = param.detach().clone()
        param.grad = torch.tensor([g], dtype=torch.float64)
        optimizer.step()
        steps.append(abs(float(param.detach() - before)))
    return steps


def test_the_bound_is_the_farthest_step_torchs_adam_takes():
    """A gradient growing by b2 / b1 a step reaches the bound; no sequence passes it."""
    beta1, beta2 = 0.9, 0.95
    bound = adam_step_bound((beta1, beta2))
    growing = adam_steps([1e-6 * (beta2 / beta1) ** t for t in range(700)], (beta1, beta2))
    assert max(growing) <= bound * (1 + 1e-9) and growing[-1] > 0.999 * bound
    generator = torch.Generator().manual_seed(0)
    for betas in ((0.9, 0.999), (0.9, 0.95), (0.5, 0.9)):
        for _ in range(5):
            scale = torch.exp(torch.randn(300, generator=generator, dtype=torch.float64) * 3)
            gradients = (torch.randn(300, generator=generator, dtype=torch.float64) * scale).tolist()
            assert max(adam_steps(gradients, betas)) <= adam_step_bound(betas) * (1 + 1e-9)
    assert adam_step_bound((0.99, 0.95)) == float("inf")  # b1^2 >= b2: Adam's own steps are unbounded


def frozen_on_small_gradients(exchange, bounded):
    """A net whose variance froze at step 10 while its gradients were 1000 times smaller than the next one."""
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


@pytest.mark.parametrize("bounded", [True, False])
def test_a_frozen_gradient_step_moves_no_coordinate_farther_than_adam_could(bounded):
    net, optimizer, _ = frozen_on_small_gradients("gradient", bounded)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer.zero_grad()
    net(torch.randn(4, 6)).square().sum().backward()
    given = [p.grad.clone() for p in net.parameters()]
    optimizer.step()
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(net.parameters(), before)) / 1e-3
    bound = adam_step_bound((0.9, 0.999))
    if bounded:  # the bound binds (the variance is far too small) and is never passed
        assert bound * 0.999 < moved <= bound * (1 + 1e-5)
    else:
        assert moved > 10 * bound
    assert all(torch.equal(p.grad, g) for p, g in zip(net.parameters(), given))  # .grad as the loop left it


@pytest.mark.parametrize("bounded", [True, False])
def test_what_a_rank_compresses_holds_each_steps_share_within_the_bound(bounded):
    """Momentum exchange: each step adds at most the bound per coordinate to what a rank compresses; the
    rank's first moment itself (its state) is not clipped."""
    net, optimizer, stage = frozen_on_small_gradients("momentum", bounded)
    keys = [n for n, _ in net.named_parameters()]
    numels = [p.numel() for p in net.parameters()]
    grad = torch.linspace(-1, 1, sum(numels))
    start = torch.cat([optimizer.state[p]["exp_avg"].reshape(-1) for p in net.parameters()])
    sent = stage.before_compress(keys, numels, grad, gradcomp.TopK(0.01))
    stage.commit(keys)
    bound = adam_step_bound((0.9, 0.999))
    assert (float(sent.abs().max()) == pytest.approx(bound)) if bounded else float(sent.abs().max()) > 10 * bound
    torch.testing.assert_close(torch.cat([stage.moments[k] for k in keys]), torch.lerp(start, grad, 1 - 0.8))


@pytest.mark.parametrize("exchange", ["gradient", "momentum"])
def test_where_the_bound_does_not_bind_the_step_is_bitwise_the_unbounded_one(exchange):
    """Gradients of the scale the variance froze on: bounded and unbounded stages move alike, bit for bit."""
    nets = []
    for bounded in (True, False):
        net, optimizer, stage = frozen_on_small_gradients(exchange, bounded)
        keys = [n for n, _ in net.named_parameters()]
        numels = [p.numel() for p in net.parameters()]
        generator = torch.Generator().manual_seed(2)
        for _ in range(3):
            optimizer.zero_grad()
            net(1e-3 * torch.randn(4, 6, generator=generator)).square().sum().backward()
            grad = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
            sent = stage.before_compress(keys, numels, grad, gradcomp.TopK(0.01))
            assert float(sent.abs().max()) < adam_step_bound((0.9, 0.999))
            stage.commit(keys)
            stage.after_average(keys, numels, sent, dense=False)
            for p, piece in zip(net.parameters(), sent.split(numels)):
                p.grad = piece.reshape(p.shape)
            optimizer.step()
        nets.append(net)
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
