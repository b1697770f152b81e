"""Ranks that disagree on their settings fail with one clear error before anything is
exchanged, instead of a Gloo abort, a segfault, a hang or a silent divergence. Real Gloo ranks."""
import pytest

import reliability_workers as rw
from gradcomp import Auto
from gradcomp.agreement import AGREEMENT_FIELDS
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
     ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto()}), "policy"),
    # Settings of the slots, each stated by the slot's own settings().
    ("auto_dense_margin", ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto(dense_margin=0.05)}),
     ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto(dense_margin=0.5)}), "policy", "dense_margin"),
    ("auto_recheck_every", ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto(recheck_every=100)}),
     ("topk:0.01", {**BASE, "warmup_steps": 2, "policy": Auto(recheck_every=3)}), "policy", "recheck_every"),
    ("adamw_freeze_step", ("topk:0.01", {**BASE, "transform": ("adamw", {"freeze_step": 2})}),
     ("topk:0.01", {**BASE, "transform": ("adamw", {"freeze_step": 3})}), "transform", "freeze_step"),
    ("adamw_exchange", ("topk:0.01", {**BASE, "transform": ("adamw", {"exchange": "momentum"})}),
     ("topk:0.01", {**BASE, "transform": ("adamw", {"exchange": "gradient"})}), "transform", "exchange"),
    ("adamw_lr", ("topk:0.01", {**BASE, "transform": ("adamw", {"lr": 1e-3})}),
     ("topk:0.01", {**BASE, "transform": ("adamw", {"lr": 2e-3})}), "transform", "lr"),
    ("adamw_betas", ("topk:0.01", {**BASE, "transform": ("adamw", {"betas": (0.9, 0.999)})}),
     ("topk:0.01", {**BASE, "transform": ("adamw", {"betas": (0.8, 0.999)})}), "transform", "betas"),
    ("residual_decay", ("topk:0.01", BASE), ("topk:0.01", {**BASE, "residual_decay": 0.9}), "error_feedback"),
    ("exchange", ("topk:0.01", BASE), ("topk:0.01", {**BASE, "exchange": "two_phase"}), "exchange"),
    ("agreeing", ("topk:0.01", BASE), ("topk:0.01", BASE), None),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cases = [case[:3] for case in CASES]
    return spawn(rw.disagreement_run, 2, str(tmp_path_factory.mktemp("agree")), cases, timeout_s=240, pg_timeout_s=30)


# One 2-rank job answers every case below; it is slow, and gradcomp.agreement runs at the set-up of every
# DDP job of the quick selection (test_every_argument_of_a_slot_is_one_of_its_settings stays quick).
@pytest.mark.slow
@pytest.mark.parametrize("label,setting,detail", [(c[0], c[3], c[4] if len(c) > 4 else None) for c in CASES[:-1]],
                         ids=[c[0] for c in CASES[:-1]])
def test_disagreeing_ranks_fail_at_once_with_one_error_naming_the_setting_and_ranks(outcomes, label, setting, detail):
    for rank in range(2):
        outcome = outcomes[rank][label]
        assert outcome["error"] is not None, f"rank {rank} trained on with different settings"
        assert outcome["mismatch"], outcome["error"]
        assert outcome["step"] == 0, "the check must come before the first exchange"
        assert f"ranks disagree on {setting}" in outcome["error"] and "ranks [0] vs ranks [1]" in outcome["error"]
        assert outcome["seconds"] < 10, "an error, not a hang until the process-group timeout"
        if detail is not None:
            assert detail in outcome["error"], f"rank {rank}: the error does not show {detail}: {outcome['error']}"


@pytest.mark.slow
def test_agreeing_ranks_pay_one_tiny_collective_per_bucket_at_set_up_and_rebuild_only(outcomes):
    for rank in range(2):
        outcome = outcomes[rank]["agreeing"]
        assert outcome["error"] is None, outcome["error"]
        agreement = outcome["stats"]["agreement"]
        buckets = len(outcome["stats"]["last_step"]["groups"])
        # One bucket, checked at step 0 (set-up) and step 1 (DDP's bucket rebuild), not at step 2;
        # each check is one allgather of one int64 per field.
        assert buckets == 1 and agreement["collectives"] == 2, agreement
        assert agreement["bytes_sent"] == 2 * 8 * len(AGREEMENT_FIELDS) == 2 * 88


@pytest.mark.parametrize("cls", ["Auto", "FrozenVarianceAdam"])
def test_every_argument_of_a_slot_is_one_of_its_settings(cls):
    """The fingerprint is each slot's settings(): an argument added to __init__ without a settings()
    entry would let ranks differ in it unnoticed."""
    import inspect

    import torch

    from gradcomp.optim import FrozenVarianceAdam

    model = torch.nn.Linear(4, 2)
    if cls == "Auto":
        slot, init = Auto(), Auto.__init__
        exempt = {"measurement_hook"}  # a test instrument: it replaces this rank's own measurements
    else:
        slot = FrozenVarianceAdam(torch.optim.AdamW(model.parameters()), model.named_parameters(), freeze_step=20)
        init, exempt = FrozenVarianceAdam.__init__, {"freeze_cost"}  # words for a notice: no replica moves by them
    settings = slot.settings()
    arguments = set(inspect.signature(init).parameters) - {"self"} - exempt
    named = set(settings)
    for group in settings.get("param_groups") or ():
        named |= {key for key, _ in group}
    missing = arguments - named
    assert not missing, f"{cls}.settings() lacks {sorted(missing)}"
    repr(settings)  # plain values: the same repr on every rank
