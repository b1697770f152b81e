"""The frozen-variance update with torch's multi-tensor ops is bitwise the update taken one parameter at a time."""
import itertools

import pytest
import torch

from gradcomp.optim.frozen_update import bounded_step, frozen_update

SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]


def one_at_a_time(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    """The reference: the update written per parameter, operation for operation."""
    beta1, lr, wd = group["betas"][0], float(group["lr"]), group["weight_decay"]
    for param, exp_avg, grad, denom, t in zip(params, exp_avgs, grads, denoms, steps):
        if exchange == "momentum":
            exp_avg.copy_(grad)
        else:
            g = grad if not (wd and not decoupled) else grad + wd * param
            exp_avg.lerp_(g, 1 - beta1)
        if wd and decoupled:
            param.mul_(1 - lr * wd)
        bias, moment = 1 - beta1**t, exp_avg
        if bounded and exchange == "gradient":
            moment = exp_avg / bounded_step(exp_avg / denom, bias)
        param.addcdiv_(moment, denom, value=-lr / bias)


def tensors(seed, scale=1.0, positive=False):
    generator = torch.Generator().manual_seed(seed)
    out = [torch.randn(shape, generator=generator) * scale for shape in SHAPES]
    return [t.abs() + 1e-3 for t in out] if positive else out


@pytest.mark.parametrize("exchange,decoupled,bounded,wd", [
    (exchange, decoupled, bounded, wd)
    for exchange, decoupled, bounded, wd in itertools.product(("momentum", "gradient"), (True, False),
                                                              (False, True), (0.0, 0.1))])
def test_the_multi_tensor_update_is_bitwise_the_update_one_parameter_at_a_time(exchange, decoupled, bounded, wd):
    group = {"lr": 3e-3, "betas": (0.9, 0.999), "weight_decay": wd}
    # Large gradients over small denominators: the bound binds on some parameters.
    grads, denoms = tensors(1, scale=50.0), tensors(2, scale=1e-2, positive=True)
    steps = [11, 11, 12, 40]  # parameters frozen at different steps keep their own bias correction
    expected_p, expected_m = tensors(3), tensors(4)
    got_p, got_m = [t.clone() for t in expected_p], [t.clone() for t in expected_m]
    for _ in range(3):
        one_at_a_time(expected_p, expected_m, grads, denoms, steps, group, decoupled, exchange, bounded)
        frozen_update(got_p, got_m, grads, denoms, steps, group, decoupled, exchange, bounded)
    for a, b in zip(expected_p + expected_m, got_p + got_m):
        assert torch.equal(a, b)
    assert not torch.equal(got_p[0], tensors(3)[0])  # it moved


def test_the_gradients_and_denominators_are_only_read():
    grads, denoms = tensors(1), tensors(2, positive=True)
    kept = [t.clone() for t in grads + denoms]
    frozen_update(tensors(3), tensors(4), grads, denoms, [5] * 4, {"lr": 1e-3, "betas": (0.9, 0.99),
                                                                  "weight_decay": 0.1}, False, "gradient", False)
    assert all(torch.equal(a, b) for a, b in zip(kept, grads + denoms))
