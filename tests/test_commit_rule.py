"""The commit rule holds for what the model receives: residuals are committed only if the
gradient written into the bucket is finite in the bucket's own dtype. Two real Gloo ranks with
float16 gradients near the float16 maximum (65504), on the allgather and two-phase exchanges."""
import pytest
import torch

import commit_workers as workers
from multiprocess import spawn


# The quick run keeps the two-phase case (every other quick DDP job runs the allgather).
@pytest.mark.parametrize("exchange", [pytest.param("allgather", marks=pytest.mark.slow), "two_phase"])
def test_a_float16_overflow_after_the_cast_commits_no_residual(tmp_path, exchange):
    results = spawn(workers.overflow_worker, 2, str(tmp_path), exchange, timeout_s=180, pg_timeout_s=30)
    for rank, record in enumerate(results):
        assert record[1]["mode"] == exchange
        # Step 0 was finite (nothing sent): its residuals were committed.
        assert torch.isfinite(record[0]["grad"]).all()
        assert any(not torch.equal(record[0]["before"].get(k, torch.zeros(0)), v)
                   for k, v in record[0]["after"].items()), f"rank {rank}: step 0 committed nothing"
        # Step 1 decodes +70000 in float32, Inf in the float16 bucket: nothing may be committed.
        assert torch.isinf(record[1]["grad"]).any(), f"rank {rank}: the test did not overflow"
        before, after = record[1]["before"], record[1]["after"]
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]), f"rank {rank}: {key} was committed on an Inf step"
    assert torch.equal(results[0][1]["grad"], results[1][1]["grad"])
