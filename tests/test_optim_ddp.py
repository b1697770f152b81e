"""The recipe's optimizer paths through the real DDP hook on 2 Gloo ranks: bitwise equal to an
independent single-process simulation, replicas bitwise equal, checkpoint/resume bitwise across
the dense start, the variance freeze and the ramp."""
import pytest
import torch

import multiprocess
import optim_workers

STEPS = 9  # dense start (Adam's freeze at 3), two ramp stages, then the final density


def assert_params_equal(a, b, what):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs by {(a[name] - b[name]).abs().max().item()}"


@pytest.mark.multiprocess
# The quick run keeps adam-momentum: the frozen variance and the momentum exchange, this file's own path.
@pytest.mark.parametrize("kind", multiprocess.slow_except(optim_workers.KINDS, quick=["adam-momentum"]))
def test_matches_independent_simulation_and_replicas_agree(kind, tmp_path):
    ranks = multiprocess.spawn(optim_workers.train_worker, 2, str(tmp_path), kind, STEPS)
    assert_params_equal(ranks[0]["params"], ranks[1]["params"], "replicas")
    expected = optim_workers.simulate(kind, STEPS)
    assert_params_equal(ranks[0]["params"], expected, "DDP vs simulation")
    # The run really compressed (not a dense run in disguise).
    assert ranks[0]["stats"]["bytes_sent"] < 0.6 * ranks[0]["stats"]["dense_bytes"]
    if kind == "adam-momentum":  # the comparison is sensitive: exchanging the gradient gives another result
        assert not torch.equal(optim_workers.simulate("adam-gradient", STEPS)["2.weight"], expected["2.weight"])


@pytest.mark.multiprocess
@pytest.mark.slow  # two 2-rank runs per case
@pytest.mark.parametrize("kind,split", [("sgd", 3), ("sgd", 6), ("adam-momentum", 3), ("adam-momentum", 5),
                                        ("adam-gradient", 4)])
def test_checkpoint_resume_is_bitwise(kind, split, tmp_path):
    """``split`` = 3: the first compressed step (and the freeze) after the resume; 4-6: inside the
    ramp, with residuals, first moments and the frozen variance saved."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    straight = multiprocess.spawn(optim_workers.train_worker, 2, str(tmp_path / "a"), kind, STEPS)
    resumed = multiprocess.spawn(optim_workers.resume_worker, 2, str(tmp_path / "b"), kind, STEPS, split)
    for rank in range(2):
        assert_params_equal(straight[rank]["params"], resumed[rank]["params"], f"rank {rank} resumed at {split}")
