"""ErrorFeedback: per-key residuals that survive regrouping, transactional commits,
and state dicts that are independent of the bucket layout."""
import io

import pytest
import torch

from gradcomp.error_feedback import ErrorFeedback


def test_new_keys_start_at_zero_and_residuals_are_float32():
    ef = ErrorFeedback()
    current, spare = ef.buffers(["a", "b"], [3, 2], "cpu")
    assert current.dtype == spare.dtype == torch.float32
    assert torch.equal(current, torch.zeros(5)) and spare.shape == (5,)


def test_commit_swaps_in_the_new_residual_and_rejection_keeps_the_old():
    ef = ErrorFeedback()
    current, spare = ef.buffers(["a"], [4], "cpu")
    spare.fill_(1.0)
    ef.commit(["a"])
    assert torch.equal(ef.residual("a"), torch.ones(4))
    current, spare = ef.buffers(["a"], [4], "cpu")
    spare.fill_(float("nan"))
    ef.commit(["a"], accept=torch.tensor(False))  # decided later, on read
    assert torch.equal(ef.residual("a"), torch.ones(4))


def test_a_decayed_commit_scales_the_new_residual_whatever_the_decision_is_read_as_later():
    ef = ErrorFeedback()
    _, spare = ef.buffers(["a"], [2], "cpu")
    spare.copy_(torch.tensor([2.0, -4.0]))
    ef.commit(["a"], accept=torch.tensor(True), decay=0.25)
    assert torch.equal(ef.residual("a"), torch.tensor([0.5, -1.0]))
    _, spare = ef.buffers(["a"], [2], "cpu")
    spare.fill_(8.0)
    ef.commit(["a"], accept=False, decay=0.25)
    assert torch.equal(ef.residual("a"), torch.tensor([0.5, -1.0]))


def test_residuals_follow_keys_when_groups_are_laid_out_differently():
    ef = ErrorFeedback()
    current, spare = ef.buffers(["w1", "b1", "w2"], [4, 2, 3], "cpu")
    spare.copy_(torch.arange(9.0))
    ef.commit(["w1", "b1", "w2"])
    # A rebuild: new groups with another order and membership.
    current, _ = ef.buffers(["w2", "w1"], [3, 4], "cpu")
    assert torch.equal(current, torch.tensor([6.0, 7, 8, 0, 1, 2, 3]))
    current, _ = ef.buffers(["b1"], [2], "cpu")
    assert torch.equal(current, torch.tensor([4.0, 5]))
    assert sorted(ef.keys()) == ["b1", "w1", "w2"]


def test_a_size_mismatch_is_an_error_not_a_silent_reset():
    ef = ErrorFeedback()
    ef.buffers(["w"], [4], "cpu")
    with pytest.raises(ValueError, match="elements"):
        ef.buffers(["w", "x"], [5, 1], "cpu")


def test_state_dict_round_trips_through_torch_save_with_weights_only():
    ef = ErrorFeedback()
    _, spare = ef.buffers(["w1", "b1"], [3, 2], "cpu")
    spare.copy_(torch.tensor([1.0, 2, 3, 4, 5]))
    ef.commit(["w1", "b1"])
    blob = io.BytesIO()
    torch.save(ef.state_dict(), blob)
    blob.seek(0)
    restored = ErrorFeedback()
    restored.load_state_dict(torch.load(blob, weights_only=True))
    # Loaded residuals land in whatever layout asks for them first.
    current, _ = restored.buffers(["b1", "w1"], [2, 3], "cpu")
    assert torch.equal(current, torch.tensor([4.0, 5, 1, 2, 3]))


def test_load_state_dict_rejects_malformed_input_and_resets_non_finite():
    ef = ErrorFeedback()
    with pytest.raises(ValueError, match="residuals"):
        ef.load_state_dict({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="1-D float"):
        ef.load_state_dict({"residuals": {"w": torch.zeros(3, dtype=torch.int64)}})
    with pytest.warns(UserWarning, match="not finite"):
        ef.load_state_dict({"residuals": {"w": torch.tensor([1.0, float("nan")])}})
    assert torch.equal(ef.residual("w"), torch.zeros(2))
