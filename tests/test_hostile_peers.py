"""Hostile peers over real Gloo: 2 DDP ranks registered with ``gradcomp.hooks.ddp.register``,
where rank 1 corrupts its top-k payload after compressing it (same compressor settings,
so the cross-rank settings check passes and only payload validation can catch it).

On every rank: a clear gradcomp error naming rank 1 as the sender, no crash, the residuals
exactly as before the step, and the bucket untouched (it still holds this rank's own local
gradient, bit for bit).
"""
import pytest
import torch

import hostile_workers as workers
import multiprocess
from gradcomp.backends import is_available

CASES = [("torch", corruption) for corruption in workers.CORRUPTIONS]
CASES += [("numba", corruption) for corruption in ("out_of_range", "duplicate", "random_bytes")]
CASES = multiprocess.slow_except(CASES, quick=[("torch", "out_of_range")])
pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("backend,corruption", CASES)
def test_a_corrupt_peer_gets_a_clear_error_on_every_rank_and_changes_nothing(tmp_path, backend, corruption):
    if not is_available(backend, "cpu"):
        pytest.skip(f"backend {backend!r} is not installed")
    results, codes = multiprocess.spawn(workers.hostile_step, 2, str(tmp_path), corruption, backend, timeout_s=240,
                                        check=False, pass_out_dir=True)
    assert all(result is not None for result in results), f"a rank saved nothing; exit codes {codes}"
    assert results[1]["corrupted_payloads"] >= 1, "the hostile rank never corrupted a payload"
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank}: the corrupt payload was accepted"
        assert "gradcomp: rejected the payload sent by rank 1" in error, f"rank {rank}: {error[:2000]}"
        assert "group" in error, f"rank {rank}: the error does not name the bucket: {error[:2000]}"
        before, after = result["residuals_before"], result["residuals_after"]
        assert any("residuals" in key for key in before), f"rank {rank}: no residuals in the state dict"
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key].view(-1).view(torch.uint8), after[key].view(-1).view(torch.uint8)), (
                f"rank {rank}: {key} changed in the rejected step"
            )
        for name, local in result["local_grads"].items():
            assert torch.equal(result["grads_after"][name], local), f"rank {rank}: the bucket of {name} was written"
    assert codes == [0, 0], f"ranks exited with {codes}"


@pytest.mark.slow  # 3 ranks; the quick run keeps the 2-rank top-k case above
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_two_phase_a_corrupt_chunk_or_average_gets_the_same_error_on_every_rank(tmp_path, backend):
    """P = 3: rank 1 corrupts its phase-1 chunks (every owner rejects one of them) or its phase-2
    average. Every rank raises PayloadError naming rank 1 well within the 30 s Gloo timeout, and
    nothing changed: the gradient, the first-stage residuals and the owners' residuals."""
    if not is_available(backend, "cpu"):
        pytest.skip(f"backend {backend!r} is not installed")
    results, codes = multiprocess.spawn(workers.two_phase_hostile, 3, str(tmp_path), backend, timeout_s=240,
                                        pg_timeout_s=30, check=False, pass_out_dir=True)
    assert all(result is not None for result in results), f"a rank saved nothing; exit codes {codes}"
    for case in workers.TWO_PHASE_CASES:
        assert results[1][case]["corrupted"] >= 1, f"{case}: the hostile rank never corrupted a payload"
        errors = set()
        for rank, result in enumerate(results):
            outcome = result[case]
            error = outcome["error"]
            assert error is not None, f"{case} rank {rank}: the corrupt payload was accepted"
            first_line = error.splitlines()[0]
            assert first_line.startswith("PayloadError: gradcomp: rejected the payload sent by rank 1"), (
                f"{case} rank {rank}: {error[:2000]}")
            assert "group 'g', two-phase" in first_line, f"{case} rank {rank}: {first_line}"
            assert outcome["seconds"] < 20, f"{case} rank {rank}: {outcome['seconds']:.1f} s, a wait for the timeout"
            errors.add(first_line)
            assert torch.equal(outcome["grad_before"], outcome["grad_after"]), f"{case} rank {rank}: bucket written"
            before, after = outcome["before"], outcome["after"]
            assert before.keys() == after.keys() and any("residuals" in key for key in before)
            for key in before:
                assert torch.equal(before[key].view(-1).view(torch.uint8), after[key].view(-1).view(torch.uint8)), (
                    f"{case} rank {rank}: {key} changed in the rejected step")
        assert len(errors) == 1, f"{case}: ranks raised different errors: {errors}"
    assert codes == [0, 0, 0], f"ranks exited with {codes}"
