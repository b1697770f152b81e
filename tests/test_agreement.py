"""Ranks that disagree on their settings fail with one clear error before anything is
exchanged, instead of a Gloo abort, a segfault, a hang or a silent divergence. Real Gloo ranks."""
import pytest

import reliability_workers as rw
from gradcomp import Auto
from multiprocess import spawn

pytestmark = pytest.mark.multiprocess

BASE = {"warmup_steps": 0, "min_numel": 0}
CASES = [
    # (label, rank 0 (spec, kwargs), rank 1 (spec, kwargs), the setting named in the error)
    ("topk_densities", ("topk:0.01", BASE), ("topk:0.02", BASE), "compressor"),
    ("topk_vs_twobit", ("topk:0.01", BASE), ("twobit:0.5", BASE), "compressor"),
    ("twobit_thresholds", ("twobit:0.5", BASE), ("twobit:0.25", BASE), "compressor"),
    ("min_numel", ("topk:0.01", BASE), ("topk:0.01", {**BASE, "min_numel": 100000}), "min_numel"),
    ("warmup_steps", ("topk:0.01", BASE), ("topk:0.01", {**BASE, "warmup_steps": 2}), "schedule"),
    ("policy_on_one_rank", ("topk:0.01", {**BASE, "warmup_steps": 2}),
     ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto()}), "compressor"),
    ("agreeing", ("topk:0.01", BASE), ("topk:0.01", BASE), None),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cases = [case[:3] for case in CASES]
    return spawn(rw.disagreement_run, 2, str(tmp_path_factory.mktemp("agree")), cases, timeout_s=240, pg_timeout_s=30)


@pytest.mark.parametrize("label,setting", [(c[0], c[3]) for c in CASES[:-1]], ids=[c[0] for c in CASES[:-1]])
def test_disagreeing_ranks_fail_at_once_with_one_error_naming_the_setting_and_ranks(outcomes, label, setting):
    for rank in range(2):
        outcome = outcomes[rank][label]
        assert outcome["error"] is not None, f"rank {rank} trained on with different settings"
        assert outcome["mismatch"], outcome["error"]
        assert outcome["step"] == 0, "the check must come before the first exchange"
        assert f"ranks disagree on {setting}" in outcome["error"] and "ranks [0] vs ranks [1]" in outcome["error"]
        assert outcome["seconds"] < 10, "an error, not a hang until the process-group timeout"


def test_agreeing_ranks_pay_one_tiny_collective_per_bucket_at_set_up_and_rebuild_only(outcomes):
    for rank in range(2):
        outcome = outcomes[rank]["agreeing"]
        assert outcome["error"] is None, outcome["error"]
        agreement = outcome["stats"]["agreement"]
        buckets = len(outcome["stats"]["last_step"]["groups"])
        # One bucket, checked at step 0 (set-up) and step 1 (DDP's bucket rebuild), not at step 2;
        # each check is one allgather of 9 fields x 8 bytes.
        assert buckets == 1 and agreement["collectives"] == 2, agreement
        assert agreement["bytes_sent"] == 2 * 72
