"""Mixed precision: with a real GradScaler the engine works in true-gradient units, so a run whose
loss scale grows and backs off trains exactly as the unscaled run does (2 real Gloo ranks)."""
import pytest
import torch

import amp_workers as workers
import multiprocess

pytestmark = pytest.mark.multiprocess


def spawn(tmp_path, name, *args):
    out = tmp_path / name
    out.mkdir()
    return multiprocess.spawn(workers.train_worker, 2, str(out), *args)


def test_a_growing_loss_scale_trains_bitwise_like_fp32_with_the_recipe(tmp_path):
    scaled = spawn(tmp_path, "scaled", True)
    plain = spawn(tmp_path, "plain", False)
    assert scaled[0]["scales"][0] == 2.0**8 and scaled[0]["scales"][-1] >= 2.0**14  # the scale grew step by step
    for name, value in plain[0]["params"].items():
        assert torch.equal(scaled[0]["params"][name], value), name
        assert torch.equal(scaled[1]["params"][name], value), name


@pytest.mark.slow  # a second pair of 2-rank runs; the quick run keeps the growing scale (and test_commit_rule)
def test_an_overflow_backs_the_scale_off_and_leaves_residuals_as_they_were(tmp_path):
    overflow = 10
    scaled = spawn(tmp_path, "scaled", True, overflow, False)
    plain = spawn(tmp_path, "plain", False, overflow, False)
    scales = scaled[0]["scales"]
    assert scales[overflow] == scales[overflow - 1] / 2  # GradScaler backed off on every rank
    assert scales == scaled[1]["scales"]
    for rank in range(2):  # the overflow step (infinite on rank 1 only) committed no residual anywhere
        before, after = scaled[rank]["residuals"][overflow - 1], scaled[rank]["residuals"][overflow]
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    for name, value in plain[0]["params"].items():  # and the run goes on as if that step never happened
        assert torch.equal(scaled[0]["params"][name], value), name
