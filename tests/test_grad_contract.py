"""``.grad`` keeps its meaning, and the user's loop runs as it does without gradcomp.

After ``backward()`` every ``.grad`` holds the average gradient across ranks in gradient units
(for top-k under Adam the average of the ranks' first moments, an exponential average of the
gradients), so that what a loop does between ``backward()`` and ``optimizer.step()`` -- a learning
rate set by hand, two param groups, ``no_sync`` accumulation, ``GradScaler.unscale_``,
``clip_grad_norm_``/``clip_grad_value_``, gradient-norm logging, ``zero_grad(set_to_none=True)`` --
acts as it does on dense DDP. Checked three ways:

* real DDP ranks over Gloo run the loop with the one-call recipe and match the in-process
  simulation bit for bit (also the simulation's own check);
* with a lossless compressor (top-k keeping every entry) ``.grad`` is the dense average gradient
  (or the average first moment) at every step, after the freeze included;
* during the dense start a compressed run is bitwise its dense counterpart, clip included.
"""
from __future__ import annotations

import pytest
import torch

import contract_workers as workers
import multiprocess

BASE = {"steps": 14, "lr": 0.05, "weight_decay": 0.01, "clip": 1.0, "accumulation": 2, "manual_lr": True}
CASES = {
    "adamw-topk": {"optimizer": "adamw", "spec": "topk:0.05", "lr": 5e-3},
    "adamw-twobit": {"optimizer": "adamw", "spec": "twobit:chunk", "lr": 5e-3},
    "sgdm-topk": {"optimizer": "sgdm", "spec": "topk:0.05"},
    "sgdm-twobit": {"optimizer": "sgdm", "spec": "twobit:chunk", "clip": 0.0, "clip_value": 0.02,
                    "manual_lr": False},
    # A 5-step warm-up set by hand, longer than the 2 dense steps the byte budget plans: step 5's rate does
    # not rise, so the variance freezes at step 6 and the ramp runs 4 steps late.
    "adamw-topk-late-freeze": {"optimizer": "adamw", "spec": "topk:0.05", "lr": 5e-3, "steps": 60, "warmup": 5,
                               "min_compression": 6.0},
}


def assert_logs_equal(actual: dict, expected: dict, what: str) -> None:
    for name in ("params", "grads"):
        for index, (a, e) in enumerate(zip(actual[name], expected[name])):
            assert torch.equal(a, e), f"{what}: {name}[{index}] differs (max {float((a - e).abs().max())})"
    assert actual["norms"] == expected["norms"], what


@pytest.mark.multiprocess
# Real ranks are slow; the quick run keeps the in-process checks below (the simulation against dense DDP).
@pytest.mark.slow
@pytest.mark.parametrize("case", ["adamw-topk", "sgdm-twobit", "adamw-twobit", "sgdm-topk", "adamw-topk-late-freeze"])
def test_real_ranks_run_the_loop_as_the_simulation_bitwise(tmp_path, case):
    config = {**BASE, **CASES[case]}
    real = multiprocess.spawn(workers.ddp_worker, 2, tmp_path, config, timeout_s=240)
    simulated = workers.simulated(config)
    for rank in range(2):
        assert_logs_equal(real[rank], simulated[rank], f"{case}, rank {rank}")
        opens = config["warmup"] + 1 if "warmup" in config else real[rank]["opened"]
        assert real[rank]["opened"] == simulated[rank]["opened"] == opens
    assert all(torch.equal(a, b) for a, b in zip(real[0]["params"], real[1]["params"]))  # replicas agree
    assert real[0]["stats"]["compression_ratio"] > 1.5


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("case", ["adamw-topk", "sgdm-twobit"])
def test_a_step_with_a_closure_runs_as_the_loop_without_one(tmp_path, case):
    # optimizer.step(closure): backward and the clip happen inside the step, so an optimizer stage
    # that ran before the closure would act on no gradient (after zero_grad) and diverge here.
    config = {**BASE, **CASES[case], "closure": True}
    real = multiprocess.spawn(workers.ddp_worker, 2, tmp_path, config, timeout_s=240)
    simulated = workers.simulated(config)  # the same loop with a plain optimizer.step()
    for rank in range(2):
        assert_logs_equal(real[rank], simulated[rank], f"{case} with a closure, rank {rank}")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grad_scaler_and_a_scheduler_on_real_ranks(tmp_path):
    config = {**BASE, "optimizer": "adamw", "spec": "topk:0.05", "lr": 5e-3, "scaler": True, "manual_lr": False}
    real = multiprocess.spawn(workers.ddp_worker, 2, tmp_path, config, timeout_s=240)
    simulated = workers.simulated(config)
    assert_logs_equal(real[0], simulated[0], "GradScaler, rank 0")
    assert all(n == n for n in real[0]["norms"])


def local_and_average_grads(config: dict, steps: int, exchange=None):
    """Per step, the ranks' own gradients before the exchange and ``.grad`` after it (rank 0);
    ``exchange`` overrides what the Adam stage exchanges."""
    from experiments.simulate import Simulation
    from gradcomp.engine import Engine
    from gradcomp.optim import FrozenVarianceAdam
    from gradcomp.setup import prepare

    def attach(rank, replica, optimizer, transport):
        setup = prepare(config["spec"], replica.named_parameters(), optimizer=optimizer, total_steps=steps,
                        min_compression=1.0, min_numel=256, announce=False)
        if exchange is not None:
            optimizer._optimizer_step_pre_hooks.clear()  # the recipe's stage, replaced by this one
            setup.settings["transform"] = FrozenVarianceAdam(optimizer, replica.named_parameters(),
                                                             setup.recipe.dense_steps, exchange=exchange)
        return Engine(setup.compressor, transport, **setup.settings)

    sim = Simulation(workers.make_model(), lambda m: workers.build_optimizer({**BASE, **config}, m)[0], attach)
    out = []
    for s in range(steps):
        for rank, replica in enumerate(sim.replicas):
            workers.loss_fn(replica, *workers.batch(rank, s)).backward()
        local = [replica[2].weight.grad.clone() for replica in sim.replicas]
        sim.exchange()
        out.append((local, sim.replicas[0][2].weight.grad.clone()))
        sim.step()
        sim.zero_grad()
    return out, sim


@pytest.mark.parametrize("optimizer", ["adamw", "sgdm"])
def test_lossless_compression_leaves_grad_the_average_gradient(optimizer):
    """Top-k keeping every entry is lossless: ``.grad`` is then the dense average at every step,
    after the variance froze too (Adam's update units are mapped back to gradient units). Adam's
    stage exchanges the gradient here as it does for quantizers (the recipe's choice for 2-bit)."""
    config = {"optimizer": optimizer, "spec": "topk:1.0", "lr": 5e-3}
    steps = 300  # the recipe's dense start is 15 steps here; the rest are compressed
    exchange = "gradient" if optimizer == "adamw" else None
    for local, grad in local_and_average_grads(config, steps, exchange)[0]:
        expected = (local[0] + local[1]) / 2
        torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7)


def test_sparsifier_under_adam_leaves_grad_the_average_gradient():
    """Top-k under Adam exchanges the gradient (its late coordinates caught up in the stage's step): with every
    entry kept, ``.grad`` is the average of the ranks' gradients at every step, the dense start's and after the
    freeze."""
    config = {"optimizer": "adamw", "spec": "topk:1.0", "lr": 5e-3}
    log, sim = local_and_average_grads(config, 300)
    stage = sim.engines[0].transform
    assert stage.exchange == "gradient" and stage.guard is None
    assert len(log) > stage.freeze_step + 5
    for local, grad in log:
        torch.testing.assert_close(grad, (local[0] + local[1]) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["topk:0.05", "twobit:chunk"])
def test_a_binding_clip_in_the_dense_start_trains_as_dense(spec):
    """The recipe's dense start is dense DDP exactly for DDP's first two steps, then its fp16 cast: with a
    clip that binds (max norm 0.05), the compressed run's gradients equal the dense run's, bit for bit, for
    two steps, and within float16's rounding (2^-11 of each entry) up to the freeze."""
    config = {**BASE, "optimizer": "adamw", "lr": 5e-3, "clip": 0.05, "accumulation": 1, "steps": 100}
    dense_start = 5  # 5% of the run
    compressed = workers.simulated({**config, "spec": spec})
    dense = workers.simulated({**config, "spec": None})
    assert all(norm > 0.05 for norm in dense[0]["norms"][:dense_start])  # the clip binds
    for s in range(2):
        assert torch.equal(compressed[0]["grads"][s], dense[0]["grads"][s])
    for s in range(2, dense_start):
        ours, theirs = compressed[0]["grads"][s], dense[0]["grads"][s]
        assert 0 < float((ours - theirs).norm() / theirs.norm()) < 2**-11  # cast, not compressed
        assert compressed[0]["norms"][s] == pytest.approx(dense[0]["norms"][s], rel=2**-11)


@pytest.mark.multiprocess
@pytest.mark.slow
# adamw-topk-late-freeze at 4: saved while the freeze waits for the warm-up's end (the gate's state resumes).
@pytest.mark.parametrize("case,split", [("adamw-topk", 9), ("sgdm-twobit", 5), ("adamw-topk-late-freeze", 4)])
def test_one_file_from_rank_0_resumes_bitwise(tmp_path, case, split):
    """A loop that saves one dict from rank 0 (``state.full_state_dict()``: every rank's residuals and
    first moments) and loads it on every rank resumes bitwise, after the freeze; ``stats()`` totals
    continue."""
    config = {**BASE, **CASES[case]}
    (tmp_path / "whole").mkdir()
    (tmp_path / "resumed").mkdir()
    whole = multiprocess.spawn(workers.ddp_worker, 2, tmp_path / "whole", config, timeout_s=240)
    resumed = multiprocess.spawn(workers.one_file_resume_worker, 2, tmp_path / "resumed", config, split,
                                 timeout_s=240, pass_out_dir=True)
    for rank in range(2):
        for a, b in zip(whole[rank]["params"], resumed[rank]["params"]):
            assert torch.equal(a, b), f"rank {rank}"
        counts = ("bytes_sent", "dense_bytes", "steps")  # compress_s is a time, different every run
        assert {k: resumed[rank]["stats"][k] for k in counts} == {k: whole[rank]["stats"][k] for k in counts}
