"""``gradcomp.policy.Auto`` on 2 real Gloo ranks through the DDP hook: the ranks agree on every
choice even when their own measurements differ (injected through the policy's documented
``measurement_hook``), a very slow link picks compression, a very fast one dense, and the
replicas stay bitwise equal."""
import math

import pytest
import torch

import multiprocess
import policy_workers as workers
from gradcomp import costmodel
from gradcomp.policy import Auto
from gradcomp.step_trial import StepTrial

STEPS = 5


def run(tmp_path, link_s_by_rank, kernel_scale_by_rank):
    # trial_steps=0: these check the cost model's choices, which the measured trial would hold back.
    return multiprocess.spawn(workers.auto_worker, 2, str(tmp_path), link_s_by_rank, kernel_scale_by_rank, STEPS,
                              100, None, 0, timeout_s=240)


def check_agreement_and_replicas(results):
    policies = [r["policy"] for r in results]
    assert policies[0]["link"] == policies[1]["link"] and policies[0]["link"] is not None
    choices = [{g: d["choice"] for g, d in p["groups"].items()} for p in policies]
    assert choices[0] == choices[1] and len(choices[0]) >= 2, choices
    predicted = [{g: d["predicted_s"] for g, d in p["groups"].items()} for p in policies]
    assert predicted[0] == predicted[1]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    assert results[0]["modes"] == results[1]["modes"]
    return choices[0]


# Every 2-rank run is slow; the quick run keeps the in-process checks at the end of this file.
@pytest.mark.multiprocess
@pytest.mark.slow
def test_very_slow_link_picks_compression_and_ranks_agree(tmp_path):
    # Ranks measure different link times (3 s and 5 s per bucket) and kernel times (x1, x3).
    results = run(tmp_path, [3.0, 5.0], [1.0, 3.0])
    choices = check_agreement_and_replicas(results)
    assert all(choice in ("twobit:chunk", "topk:0.01") for choice in choices.values()), choices
    # After warm-up the buckets really travel compressed (gathered payloads).
    assert all(mode == "dense" for mode in results[0]["modes"][0].values())
    assert any(mode == "allgather" for mode in results[0]["modes"][-1].values()), results[0]["modes"][-1]
    # Predicted and measured times are reported for every group.
    for decision in results[0]["policy"]["groups"].values():
        assert decision["predicted_s"]["dense"] > decision["predicted_s"][decision["choice"]]
        assert decision["measured_s"] is not None and decision["measured_s"] >= 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_nan_measurement_on_one_rank_is_dropped_by_every_rank(tmp_path):
    # Rank 1's clock gives NaN for every link and kernel time; rank 0's are valid. No rank raises
    # alone: the NaNs are shared as missing, and both ranks decide from rank 0's times.
    results = run(tmp_path, [3.0, math.nan], [1.0, math.nan])
    choices = check_agreement_and_replicas(results)
    assert all(choice in ("twobit:chunk", "topk:0.01") for choice in choices.values()), choices


@pytest.mark.multiprocess
@pytest.mark.slow
def test_no_valid_link_time_anywhere_raises_the_same_error_on_every_rank(tmp_path):
    results = multiprocess.spawn(workers.auto_error_worker, 2, str(tmp_path), [math.nan, math.inf], [1.0, 1.0],
                                STEPS, timeout_s=240, pg_timeout_s=30)
    errors = [r.get("error") for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "no rank measured a valid link time" in errors[0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_very_fast_link_stays_dense_and_ranks_agree(tmp_path):
    results = run(tmp_path, [1e-7, 2e-7], [1.0, 0.5])
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"dense"}, choices
    assert all(mode == "dense" for step in results[0]["modes"] for mode in step.values())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_link_that_changes_is_measured_and_decided_again(tmp_path):
    # Warm-up measures a very slow link (compression); the exchanges afterwards take ~nothing, so at the
    # check after 2 compressed steps the link is rescaled and every group goes dense.
    results = multiprocess.spawn(workers.auto_worker, 2, str(tmp_path), "drift", None, 7, 2, None, 0, timeout_s=240)
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"dense"}, choices
    modes = results[0]["modes"]
    assert any(mode == "allgather" for mode in modes[workers.WARMUP].values()), modes
    assert all(mode == "dense" for mode in modes[-1].values()), modes


def run_trial(tmp_path, step_s_by_rank, steps=11, candidates=("topk:0.01", "twobit:chunk", "fp16")):
    """A very slow injected link (the model predicts compression) and injected whole-step times; 2
    cycles: step 2 decides (compressed, untimed), then flush, dense, compressed at 3-5 and 6-8, and the
    verdict falls at step 9. A choice found no faster: step 9 dense, step 10 decides from the rest."""
    return multiprocess.spawn(workers.auto_worker, 2, str(tmp_path), [3.0, 5.0], [1.0, 1.0], steps, 100,
                              step_s_by_rank, 2, None, candidates, timeout_s=240)


def trial_steps(first, trials):
    """The steps that compress when trials of 2 cycles follow each other from ``first`` (each: the
    deciding step, two compressed arms, then the verdict's dense step)."""
    return [first + 8 * t + offset for t in range(trials) for offset in (0, 3, 6)]


def compressed_steps(modes):
    return [i for i, step in enumerate(modes) if any(mode != "dense" for mode in step.values())]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compression_the_steps_measure_no_faster_goes_dense_on_every_rank(tmp_path):
    # The model predicts compression; rank 0 measures compressed steps faster, rank 1 slower: the
    # slowest rank's medians decide (1.0 s compressed against 0.9 s dense), on both ranks alike. Every
    # candidate gets a trial (the ones a choice used drop out together) and then every group goes dense.
    steps = [{"uncompressed": 0.5, "compressed": 0.2}, {"uncompressed": 0.9, "compressed": 1.0}]
    results = run_trial(tmp_path, steps, steps=30)
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"dense"}, choices
    policy = results[0]["policy"]
    assert policy["rejected"] == results[1]["policy"]["rejected"] == ["fp16", "topk:0.01", "twobit:chunk"]
    # Rank 1's ratio, 1.0 / 0.9, is the slowest rank's: compression does not pay there.
    assert policy["trial"] == results[1]["policy"]["trial"] == {"dense_step_s": 0.9, "compressed_step_s": 1.0,
                                                                "paired_ratio": pytest.approx(1.0 / 0.9),
                                                                "kept": False}
    compressed = compressed_steps(results[0]["modes"])
    trials = len(compressed) // 3
    assert trials in (2, 3) and compressed == trial_steps(2, trials), compressed
    assert all(mode == "dense" for step in results[0]["modes"][2 + 8 * trials - 1:] for mode in step.values())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_choice_the_steps_measure_no_faster_gives_way_to_the_next_candidate(tmp_path):
    # The first trial's compressed steps are slower than dense, the second's faster: the compressors of
    # the first choice drop out, and the second choice, from the candidates left, is kept.
    steps = [{"uncompressed": 0.9, "compressed": [1.0, 0.3]}, {"uncompressed": 0.9, "compressed": [1.1, 0.4]}]
    results = run_trial(tmp_path, steps, steps=20)
    choices = check_agreement_and_replicas(results)
    rejected = results[0]["policy"]["rejected"]
    assert rejected and set(choices.values()).isdisjoint(rejected + ["dense"]), (rejected, choices)
    assert results[0]["policy"]["trial"]["kept"] is True
    compressed = compressed_steps(results[0]["modes"])
    assert compressed[:6] == trial_steps(2, 2) and compressed[6:] == list(range(17, 20)), compressed


@pytest.mark.multiprocess
@pytest.mark.slow
def test_after_a_dense_verdict_a_faster_link_decides_nothing_again(tmp_path):
    # Compression measured slower sends every group dense at step 9 (top-k, the only candidate). The
    # exchanges then take half the predicted time (the link looks twice as fast, still slow enough for the
    # model to predict compression), and the check at step 10 sees it: dense stays dense, with no second
    # trial of slower steps (which would compress at steps 10, 13 and 16).
    steps = [{"uncompressed": 0.5, "compressed": 0.6}, {"uncompressed": 0.5, "compressed": 0.6}]
    results = multiprocess.spawn(workers.auto_worker, 2, str(tmp_path), [3.0, 5.0], [1.0, 1.0], 20, 8,
                                 steps, 2, 1.5, ("topk:0.01",), timeout_s=240)
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"dense"}, choices
    compressed = [i for i, step in enumerate(results[0]["modes"]) if any(m == "allgather" for m in step.values())]
    assert compressed == [2, 5, 8], results[0]["modes"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("exchange_s, compressed_after", [(6.0, []), (60.0, [10, 13, 16])])
def test_after_a_dense_verdict_a_slower_link_decides_again_only_if_the_trials_steps_would_win(
        tmp_path, exchange_s, compressed_after):
    # Top-k's trial measured its steps at 120 s against dense's 100 s: every group dense at step 9. The exchanges
    # then take exchange_s against the 4.0 s and 2.0 s predicted. 6 s: at the check at step 10 the link looks 2.3x
    # slower, dense's steps ~8 s longer, still faster than top-k's 120 s: dense stays, no second trial of slower
    # steps. 60 s: 23x slower, dense's steps ~130 s longer: decided again, a second trial (compressed at 10-16).
    steps = [{"uncompressed": 100.0, "compressed": 120.0}, {"uncompressed": 100.0, "compressed": 120.0}]
    results = multiprocess.spawn(workers.auto_worker, 2, str(tmp_path), [3.0, 5.0], [1.0, 1.0], 20, 8,
                                 steps, 2, exchange_s, ("topk:0.01",), timeout_s=240)
    check_agreement_and_replicas(results)
    compressed = [i for i, step in enumerate(results[0]["modes"]) if any(m == "allgather" for m in step.values())]
    assert compressed == [2, 5, 8] + compressed_after, results[0]["modes"]
    assert results[0]["policy"]["rejected"] == results[1]["policy"]["rejected"] == ["topk:0.01"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compression_the_steps_measure_faster_is_kept(tmp_path):
    steps = [{"uncompressed": 1.0, "compressed": 0.3}, {"uncompressed": 1.2, "compressed": 0.4}]
    results = run_trial(tmp_path, steps)
    choices = check_agreement_and_replicas(results)
    assert all(choice in ("twobit:chunk", "topk:0.01") for choice in choices.values()), choices
    assert results[0]["policy"]["trial"] == {"dense_step_s": 1.2, "compressed_step_s": 0.4,
                                             "paired_ratio": pytest.approx(0.4 / 1.2), "kept": True}
    assert any(mode == "allgather" for mode in results[0]["modes"][-1].values()), results[0]["modes"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_while_every_group_goes_dense_the_recipes_adam_stage_steps_aside(tmp_path):
    # The recipe's frozen-variance Adam works around every exchange; once the trial sends every group
    # dense, the user's AdamW steps the parameters itself until compression comes back.
    steps = [{"uncompressed": 0.5, "compressed": 0.2}, {"uncompressed": 0.9, "compressed": 1.0}]
    results = multiprocess.spawn(workers.auto_recipe_worker, 2, str(tmp_path), steps, 16, 40, timeout_s=240)
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"dense"}, choices
    assert results[0]["policy"]["trial"]["kept"] is False
    for result in results:
        modes, suspended, cleared = result["modes"], result["suspended"], result["cleared"]
        compressed = [i for i, m in enumerate(modes) if any(mode != "dense" for mode in m.values())]
        assert compressed, modes  # the trial's compressed arm ran, with the stage at work
        assert all(cleared[i] == 6 for i in compressed), (compressed, cleared)
        # The trial starts at the recipe's dense start's end; it steps aside for each timed dense step,
        # after a flush step through it.
        start = result["dense_steps"]
        assert compressed == [start, start + 3, start + 6], (start, compressed)
        assert [suspended[i] for i in range(start + 1, start + 4)] == [False, True, False], suspended
        assert [cleared[i] for i in (start + 1, start + 2)] == [6, 0], cleared
        # The first all-dense step after the verdict flushes the residuals through the stage; the
        # next step starts with it suspended, and from then on AdamW steps every parameter itself.
        verdict = compressed[-1] + 1
        assert not suspended[verdict - 1] and cleared[verdict] == 6, (suspended, cleared)
        assert all(suspended[verdict + 1:]) and not any(cleared[verdict + 1:]), (verdict, suspended, cleared)
        assert result["frozen_denoms"] == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_after_top_k_is_found_slower_the_recipe_runs_fp16_with_the_users_adam(tmp_path):
    # Top-k's steps are slower than dense, fp16's faster: after top-k's trial every group goes fp16, and
    # a cast holds nothing back, so the stage stays aside: the user's AdamW steps every parameter.
    steps = [{"uncompressed": 0.9, "compressed": [1.0, 0.3]}, {"uncompressed": 0.9, "compressed": [1.1, 0.4]}]
    results = multiprocess.spawn(workers.auto_recipe_worker, 2, str(tmp_path), steps, 30, 40,
                                 ("topk:0.01", "fp16"), timeout_s=240)
    choices = check_agreement_and_replicas(results)
    assert set(choices.values()) == {"fp16"}, choices
    # the recipe's own top-k: compact entries at twice the density
    assert results[0]["policy"]["rejected"] == ["topk:0.02,entries=compact"]
    assert results[0]["policy"]["trial"]["kept"] is True
    for result in results:
        modes, suspended, cleared = result["modes"], result["suspended"], result["cleared"]
        start = result["dense_steps"]
        retry = start + 8  # top-k's trial: decided at start, compressed arms at start + 3 and + 6, verdict + 7
        assert compressed_steps(modes)[:3] == [start, start + 3, start + 6], modes
        assert cleared[start + 7] == 6 and not suspended[start + 7], (cleared, suspended)  # the flush, through it
        assert all(suspended[retry:]) and not any(cleared[retry:]), (suspended, cleared)
        fp16 = [i for i, m in enumerate(modes) if any(mode == "allreduce" for mode in m.values())]
        assert fp16[:3] == [retry, retry + 3, retry + 6] and fp16[3:] == list(range(retry + 7, 30)), fp16
        assert result["frozen_denoms"] == 0


class FakeClock:
    """Step times for :class:`StepTrial` without waiting: ``seconds[arm]`` per step, or a function of the step."""

    def __init__(self, seconds, drift=lambda step: 1.0):
        self.seconds, self.drift, self.step = seconds, drift, 0

    def __call__(self, arm, measured):
        return self.seconds[arm] * self.drift(self.step - 1)  # the step that just closed


def drive(trial, steps, decide_at, dense_s, compressed_s, gather=lambda values: values, drift=lambda step: 1.0):
    """Run ``trial`` through ``steps`` steps, a decision to compress taken at ``decide_at``; returns the
    part each step played (``trial.arm``) and the step it judged at (``None``: never)."""
    clock = FakeClock({"uncompressed": dense_s, "compressed": compressed_s}, drift)
    arms, judged = [], None
    for step in range(steps):
        clock.step = step
        trial.new_step(step, clock)
        if step == decide_at:
            trial.begin(step)
        if trial.due(step) and judged is None:
            judged = step
            trial.judge(gather)
        arms.append(trial.arm(step))
    return arms, judged


def test_the_trial_takes_dense_and_compressed_steps_in_turn_after_a_flush():
    trial = StepTrial(3, 0.05)
    arms, judged = drive(trial, 14, decide_at=2, dense_s=1.0, compressed_s=0.9)
    # Step 2 decides and runs the kernels cold; then 3 cycles of flush, dense, compressed.
    assert arms[:3] == [None] * 3 and arms[3:12] == ["flush", "uncompressed", "compressed"] * 3 and judged == 12
    assert trial.verdict == {"dense_step_s": 1.0, "compressed_step_s": 0.9, "paired_ratio": pytest.approx(0.9),
                             "kept": True}


def test_within_the_margin_is_dense():
    trial = StepTrial(3, 0.05)
    drive(trial, 14, decide_at=0, dense_s=1.0, compressed_s=0.97)
    assert trial.verdict["kept"] is False  # 3 % faster is within the 5 % margin: dense


def test_the_machines_drift_between_cycles_cancels_in_the_pairs():
    # Compression is 10 % slower step for step, but the machine slows 40 % over the trial: dense steps
    # taken first as a block, then compressed ones, would have found compression faster.
    trial = StepTrial(4, 0.05)
    drive(trial, 20, decide_at=0, dense_s=1.0, compressed_s=1.1, drift=lambda step: 1.4 if step < 7 else 1.0)
    assert trial.verdict["paired_ratio"] == pytest.approx(1.1) and trial.verdict["kept"] is False


def test_a_link_change_drops_the_running_trial():
    trial = StepTrial(2, 0.05)
    trial.new_step(0)
    trial.begin(0)
    assert [trial.forces_dense(s) for s in (1, 2, 3)] == [True, True, False]
    assert [trial.suspends_stage(s) for s in (1, 2, 3)] == [False, True, False]
    trial.restart(2)
    assert trial.arm(2) is None and not trial.due(20)
    trial.begin(2)  # decided again: a trial from scratch
    assert trial.arm(3) == "flush" and not trial.due(8) and trial.due(9)


def test_a_rejected_trial_would_win_only_on_a_link_slower_by_enough():
    trial = StepTrial(2, 0.05)
    assert trial.would_win(0.0)  # nothing measured: nothing speaks against deciding again
    drive(trial, 10, decide_at=1, dense_s=1.0, compressed_s=1.2)
    assert trial.verdict["kept"] is False and trial.best_rejected == trial.verdict
    # Compressed steps of 1.2 s win by the 5 % margin once dense's take 1.2 / 0.95 = 1.263 s.
    assert not trial.would_win(0.0) and not trial.would_win(0.25) and trial.would_win(0.27)
    drive(trial, 10, decide_at=1, dense_s=1.0, compressed_s=1.5)  # a worse choice: the closer one stays
    assert trial.best_rejected["paired_ratio"] == pytest.approx(1.2)
    trial.restart(10)  # the link changed: the rejections measured the old one
    assert trial.best_rejected is None and trial.would_win(0.0)


def test_an_unmeasured_arm_keeps_the_group_dense():
    # No rank measured a valid dense step (the gather gives inf): faster than nothing is not measured faster.
    trial = StepTrial(2, 0.05)
    drive(trial, 10, decide_at=1, dense_s=1.0, compressed_s=0.1, gather=lambda values: [math.inf, values[1], math.inf])
    assert trial.verdict["kept"] is False


def test_link_fit_recovers_an_alpha_beta_link():
    link = costmodel.Link(20e-6, costmodel.gbit(1.0))
    cluster = costmodel.Cluster(2, link)
    nbytes = [4096, 1 << 20, 8 << 20]
    seconds = [costmodel.predict("dense", None, n // 4, cluster).comm_s for n in nbytes]
    fitted = Auto._fit(2, nbytes, seconds)
    assert math.isclose(fitted.latency_s, link.latency_s, rel_tol=1e-6)
    assert math.isclose(fitted.bandwidth, link.bandwidth, rel_tol=1e-6)
    one = Auto._fit(2, [1 << 20], [0.01])  # one size: bandwidth only
    assert one.latency_s == 0 and math.isclose(one.bandwidth, (1 << 20) / 0.01)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="dense_margin"):
        Auto(dense_margin=1.5)
    with pytest.raises(ValueError, match="candidate"):
        Auto(candidates=())
    with pytest.raises(ValueError, match="trial_steps"):
        Auto(trial_steps=-1)


def test_the_stage_steps_aside_only_while_every_standing_choice_is_dense():
    import gradcomp
    from gradcomp.optim import FrozenVarianceAdam

    net = torch.nn.Linear(4, 2)
    stage = FrozenVarianceAdam(torch.optim.AdamW(net.parameters()), net.named_parameters(), freeze_step=10)
    auto = Auto()
    auto._pace_stage(stage)  # nothing decided yet (a dense start, or just after a resume): in place
    assert not stage.suspended
    auto._chosen = {0: None, 1: gradcomp.TopK(0.01)}
    auto._pace_stage(stage)
    assert not stage.suspended
    auto._chosen[1] = None
    auto._pace_stage(stage)
    assert stage.suspended
    auto._chosen[0] = gradcomp.TwoBit("chunk")  # a re-decision compresses one group: back
    auto._pace_stage(stage)
    assert not stage.suspended
    auto._chosen[0] = gradcomp.FP16()  # a cast holds nothing back: aside, as with dense
    auto._pace_stage(stage)
    assert stage.suspended
    auto._pace_stage(None)  # no stage, or one that cannot step aside: nothing to do
