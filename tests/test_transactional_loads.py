"""Loads of the optimizer stages validate everything before they assign anything (in-process)."""
import pytest
import torch

import gradcomp
from gradcomp.engine import Engine
from gradcomp.optim import DGC, CompressedAdamW


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _dgc_with_velocity():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0)
    dgc = DGC(model.named_parameters(), momentum=0.9, optimizer=optimizer)
    names = [n for n, _ in model.named_parameters()]
    numels = [p.numel() for _, p in model.named_parameters()]
    dgc.before_compress(names, numels, torch.ones(sum(numels)))
    dgc.commit(names)
    return model, optimizer, dgc


@pytest.mark.parametrize("bad", ["nan", "float64_overflow", "size", "unknown_key", "lr"])
def test_a_bad_dgc_state_is_rejected_by_the_engine_before_anything_is_assigned(bad):
    model, optimizer, dgc = _dgc_with_velocity()
    engine = Engine(gradcomp.TopK(0.1), transform=dgc)
    saved = engine.state_dict()
    transform = dict(saved["transform"])
    name = next(iter(transform["velocity"]))
    velocity = dict(transform["velocity"])
    if bad == "nan":
        velocity[name] = torch.full_like(velocity[name], float("nan"))
    elif bad == "float64_overflow":  # finite in float64, Inf in the float32 velocity
        velocity[name] = torch.full_like(velocity[name], 1e300, dtype=torch.float64)
    elif bad == "size":
        velocity[name] = velocity[name][:-1]
    elif bad == "unknown_key":
        transform["momentum_buffer"] = {}
    elif bad == "lr":
        transform["lr"] = {name: float("inf")}
    transform["velocity"] = velocity
    engine.step = 7
    before = {k: v.clone() for k, v in dgc.state_dict()["velocity"].items()}
    with pytest.raises(ValueError):
        engine.prepare_load({**saved, "transform": transform})  # rejected in prepare, not in assign
    assert engine.step == 7
    after = dgc.state_dict()["velocity"]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_dgc_rescale_from_a_learning_rate_of_zero_keeps_the_velocity():
    model, optimizer, _ = _dgc_with_velocity()
    dgc = DGC(model.named_parameters(), momentum=0.5, optimizer=optimizer, rescale_on_lr_change=True)
    names = [n for n, _ in model.named_parameters()]
    numels = [p.numel() for _, p in model.named_parameters()]
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # e.g. a warm-up from 0
    dgc.before_compress(names, numels, torch.ones(sum(numels)))
    dgc.commit(names)
    for group in optimizer.param_groups:
        group["lr"] = 0.1
    velocity = dgc.before_compress(names, numels, torch.zeros(sum(numels)))
    # u = 0.5 * 1 + 0: the lr change from 0 must not multiply the velocity by 0 / 0.1.
    assert torch.equal(velocity, torch.full_like(velocity, 0.5))


def _frozen_adamw():
    model = _model()
    optimizer = CompressedAdamW(model.named_parameters(), lr=1e-2, freeze_step=1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
    return model, optimizer


def test_compressed_adamw_state_after_the_freeze_without_denom_is_rejected_before_any_update():
    model, optimizer = _frozen_adamw()
    saved = optimizer.state_dict()
    last = max(saved["state"])
    saved["state"][last] = {k: v for k, v in saved["state"][last].items() if k != "denom"}
    fresh_model, fresh = _frozen_adamw()
    params_before = [p.detach().clone() for p in fresh_model.parameters()]
    state_before = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)} for k, v in
                    fresh.state_dict()["state"].items()}
    with pytest.raises(ValueError, match="denom"):
        fresh.load_state_dict(saved)
    for key, entry in fresh.state_dict()["state"].items():
        assert all(torch.equal(entry[n], state_before[key][n]) for n in state_before[key])
    # The step itself checks too: a frozen state without denom moves no parameter at all.
    del fresh.state[list(fresh_model.parameters())[-1]]["denom"]
    fresh.zero_grad()
    fresh_model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="denom"):
        fresh.step()
    assert all(torch.equal(a, b) for a, b in zip(params_before, fresh_model.parameters()))


def test_compressed_adamw_rejects_a_non_finite_moment():
    _, optimizer = _frozen_adamw()
    saved = optimizer.state_dict()
    first = min(saved["state"])
    saved["state"][first]["exp_avg"] = torch.full_like(saved["state"][first]["exp_avg"], float("nan"))
    _, fresh = _frozen_adamw()
    with pytest.raises(ValueError, match="not finite"):
        fresh.load_state_dict(saved)
