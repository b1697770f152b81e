"""The studies' training loops (experiments.loop) and workloads by name (experiments.suite)."""
import dataclasses

import pytest
import torch

from experiments import loop as loops
from experiments import suite


def test_the_gpt_loop_has_its_scripts_patterns_and_gpt_noclip_only_drops_the_clip():
    gpt = loops.loop_for("gpt", "adamw", 1000)
    assert gpt.manual_lr and gpt.clip == 1.0 and gpt.accumulation == 2 and gpt.decay_groups
    noclip = loops.loop_for("gpt-noclip", "adamw", 1000)
    assert noclip.clip == 0.0 and dataclasses.replace(noclip, clip=gpt.clip) == gpt
    assert suite.STEPS["gpt-noclip"] == suite.STEPS["gpt"]


def test_gpt_noclip_trains_the_same_model_on_the_same_data():
    a, b = suite.build("gpt", seed=3, eval_windows=4), suite.build("gpt-noclip", seed=3, eval_windows=4)
    for (name, p), (other, q) in zip(a.build_model().named_parameters(), b.build_model().named_parameters()):
        assert name == other and torch.equal(p, q)
    assert all(torch.equal(x, y) for x, y in zip(a.batch(0, 5, 4), b.batch(0, 5, 4)))


def test_warm_up_then_cosine_to_a_tenth_and_a_script_that_sets_the_rate_itself():
    loop = loops.loop_for("charlm-small", "sgdm", 200)
    assert loops.lr_at(loop, 0) == pytest.approx(loop.lr / loop.warmup)
    assert loops.lr_at(loop, loop.warmup - 1) == pytest.approx(loop.lr)
    assert loops.lr_at(loop, 200) == pytest.approx(0.1 * loop.lr)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer, scheduler = loops.build_optimizer(loops.loop_for("gpt", "adamw", 100), model)
    assert scheduler is None  # manual LR: no scheduler object
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]  # matrices, the rest
    # Under SGD the script's decoupled 0.1 becomes the L2 decay of the same shrink a step: 1e-4.
    assert loops.loop_for("gpt", "sgdm", 100).weight_decay == pytest.approx(1e-4)
    assert loops.loop_for("charlm-small", "sgdm", 100).weight_decay == 0.0
    assert optimizer.param_groups[0]["lr"] == pytest.approx(loops.lr_at(loops.loop_for("gpt", "adamw", 100), 0))
