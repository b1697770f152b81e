"""DGC and CompressedAdamW in one process: errors, masking, transactions, state dicts."""
import io

import pytest
import torch

import gradcomp
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.optim import DGC, CompressedAdamW


def small_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def test_dgc_refuses_an_optimizer_with_momentum_or_adam_moments():
    net = small_net()
    with pytest.raises(ValueError, match="momentum=0"):
        DGC(net.named_parameters(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="CompressedAdamW"):
        DGC(net.named_parameters(), optimizer=torch.optim.AdamW(net.parameters()))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0)
    dgc = DGC(net.named_parameters(), optimizer=optimizer)
    optimizer.param_groups[0]["momentum"] = 0.5  # set later: caught at the next step
    with pytest.raises(ValueError, match="owns the momentum"):
        dgc.before_compress(("0.bias",), (10,), torch.zeros(10))


def test_dgc_velocity_masking_and_transactions():
    net = small_net()
    dgc = DGC(net.named_parameters(), momentum=0.5)
    keys, numels = ("0.bias",), (10,)
    grad = torch.arange(10, dtype=torch.float32)
    u = dgc.before_compress(keys, numels, grad)
    assert torch.equal(u, grad)
    payload = gradcomp.TopK(0.2).compress(u)  # sends the two largest: indices 8, 9
    dgc.after_compress(keys, payload, gradcomp.TopK(0.2), 10)
    dgc.commit(keys, True)
    expected = grad.clone()
    expected[8:] = 0
    assert torch.equal(dgc.velocity.residual("0.bias"), expected)
    # A rejected step leaves the velocity as it was.
    dgc.before_compress(keys, numels, torch.full((10,), 100.0))
    dgc.commit(keys, torch.tensor(False))
    assert torch.equal(dgc.velocity.residual("0.bias"), expected)
    # A dense step: u = m u + g, nothing masked.
    out = dgc.dense(keys, numels, torch.ones(10))
    assert torch.equal(out, torch.add(torch.ones(10), expected, alpha=0.5))


def test_dgc_masking_defaults_off_for_quantizers():
    net = small_net()
    dgc = DGC(net.named_parameters(), momentum=0.5)
    keys = ("0.bias",)
    u = dgc.before_compress(keys, (10,), torch.linspace(-1, 1, 10))
    before = u.clone()
    compressor = gradcomp.TwoBit("rms")
    dgc.after_compress(keys, compressor.compress(u), compressor, 10)
    assert torch.equal(u, before)
    forced = DGC(net.named_parameters(), momentum=0.5, masking=True)
    u = forced.before_compress(keys, (10,), torch.linspace(-1, 1, 10))
    forced.after_compress(keys, compressor.compress(u), compressor, 10)
    assert (u == 0).any() and (u != 0).any()


def test_dgc_rescales_velocity_and_residuals_when_the_lr_changes():
    net = small_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.0)
    residuals = ErrorFeedback()
    residuals.buffers(["0.bias"], [10], "cpu")[0].fill_(1.0)
    dgc = DGC(net.named_parameters(), momentum=0.5, optimizer=optimizer, rescale_on_lr_change=True,
              residual_memory=residuals)
    keys, numels = ("0.bias",), (10,)
    dgc.before_compress(keys, numels, torch.ones(10))
    dgc.commit(keys, True)
    optimizer.param_groups[0]["lr"] = 0.05  # halved: what is held must double to move weights as far
    u = dgc.before_compress(keys, numels, torch.zeros(10))
    assert torch.equal(u, torch.full((10,), 1.0))  # 0.5 * (2 * 1) + 0
    assert torch.equal(residuals.residual("0.bias"), torch.full((10,), 2.0))


def test_dgc_state_dict_round_trip_and_mismatch():
    net = small_net()
    dgc = DGC(net.named_parameters(), momentum=0.9)
    dgc.before_compress(("0.weight",), (60,), torch.randn(60))
    dgc.commit(("0.weight",), True)
    buffer = io.BytesIO()
    torch.save(dgc.state_dict(), buffer)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    other = DGC(net.named_parameters(), momentum=0.9)
    other.load_state_dict(state)
    assert torch.equal(other.velocity.residual("0.weight"), dgc.velocity.residual("0.weight"))
    with pytest.raises(ValueError, match="settings"):
        DGC(net.named_parameters(), momentum=0.5).load_state_dict(state)
    bad = {**state, "velocity": {"nope": torch.zeros(3)}}
    with pytest.raises(ValueError, match="no parameter"):
        other.load_state_dict(bad)


def run_adam(optimizer, net, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        net(torch.randn(4, 6, generator=gen)).square().mean().backward()
        optimizer.step()


def test_compressed_adamw_warmup_is_torch_adamw_bitwise():
    net, reference = small_net(), small_net()
    ours = CompressedAdamW(net.named_parameters(), lr=1e-2, weight_decay=0.1, freeze_step=50)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    run_adam(ours, net, 7)
    run_adam(theirs, reference, 7)
    for a, b in zip(net.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_freeze_floors_zero_variance_and_the_transform_sends_momentum():
    net = small_net()
    optimizer = CompressedAdamW(net.named_parameters(), lr=1e-2, freeze_step=2)
    run_adam(optimizer, net, 2)
    bias = net[2].bias
    state = optimizer.state[bias]
    assert "denom" in state and torch.isfinite(state["denom"]).all()
    # A coordinate that never saw a gradient is floored, not left at eps.
    weight = net[0].weight
    optimizer.state[weight]["exp_avg_sq"][0, 0] = 0.0
    sqrt_v = optimizer.state[weight]["exp_avg_sq"].sqrt() / (1 - 0.999**2) ** 0.5
    floored = CompressedAdamW._freeze(sqrt_v, 0.1, 1e-8)
    assert floored[0, 0] >= 0.1 * float(sqrt_v.mean())
    # After the freeze the transform replaces the gradient by the local momentum.
    grad = torch.randn(3)
    sent = optimizer.transform.before_compress(("2.bias",), (3,), grad)
    assert torch.equal(sent, torch.lerp(state["exp_avg"].reshape(-1), grad, 0.1))


def test_compressed_adamw_state_dict_round_trips_bitwise_across_the_freeze():
    net = small_net()
    optimizer = CompressedAdamW(net.named_parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3)
    run_adam(optimizer, net, 3)
    buffer = io.BytesIO()
    torch.save({"net": net.state_dict(), "opt": optimizer.state_dict()}, buffer)
    run_adam(optimizer, net, 4, seed=2)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    net2 = small_net(seed=5)
    net2.load_state_dict(saved["net"])
    optimizer2 = CompressedAdamW(net2.named_parameters(), lr=1e-2, weight_decay=0.01, freeze_step=3)
    optimizer2.load_state_dict(saved["opt"])
    run_adam(optimizer2, net2, 4, seed=2)
    for a, b in zip(net.parameters(), net2.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="settings"):
        CompressedAdamW(net2.named_parameters(), freeze_step=9).transform.load_state_dict(
            optimizer.transform.state_dict())


@pytest.mark.parametrize("kwargs", [{"freeze_step": 0}, {"units": "weights"}, {"betas": (1.0, 0.9)},
                                    {"variance_floor": 2.0}])
def test_compressed_adamw_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        CompressedAdamW(small_net().named_parameters(), **kwargs)
