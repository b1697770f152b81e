"""Time to dense's quality (experiments.time_to_accuracy): the steps to the target from the study's
evaluations, and each step counted at the cost of the bytes it sent."""
import json

import pytest

from experiments import netem
from experiments import time_to_accuracy as tta

DENSE_BYTES = 100  # per step


def run(method: str, losses, shares, seed: int = 0) -> dict:
    """A study row whose step ``i`` sent ``shares[i]`` of dense's bytes; one evaluation per step."""
    sent = dense = 0
    bytes_to_eval = []
    for share in shares:
        sent, dense = sent + round(share * DENSE_BYTES), dense + DENSE_BYTES
        bytes_to_eval.append([sent, dense])
    return {"workload": "w", "optimizer": "sgdm", "method": method, "seed": seed, "final_loss": losses[-1],
            "evals": [[i, 0.0, loss] for i, loss in enumerate(losses)], "bytes_to_eval": bytes_to_eval,
            "final_bytes_share": shares[-1]}


def timing(method: str, link: str, step_time: float) -> dict:
    return {"workload": "w", "optimizer": "sgdm", "method": method, "link": link, "step_time": step_time,
            "spread": 0.01, "load_before": 0.1}


def test_a_step_costs_the_bytes_it_sent_between_the_final_setting_and_dense():
    # 4 dense steps at 1.0 s, then 6 at the final setting (10% of the bytes) at 0.2 s.
    shares = [1.0] * 4 + [0.1] * 6
    seconds, model = tta.run_time(run("topk", [3.0] * 10, shares), 9, step_time=0.2, dense_step_time=1.0)
    assert seconds == pytest.approx(4 * 1.0 + 6 * 0.2) and model == "per-step bytes"
    # a ramp stage at 55% of the bytes costs half way
    seconds, _ = tta.run_time(run("topk", [3.0] * 2, [0.55, 0.1]), 1, step_time=0.2, dense_step_time=1.0)
    assert seconds == pytest.approx(0.6 + 0.2)
    # a row without bytes by evaluation: every step at the final setting, and it says so
    legacy = {k: v for k, v in run("topk", [3.0] * 3, [1.0, 0.1, 0.1]).items() if k != "bytes_to_eval"}
    assert tta.run_time(legacy, 2, 0.2, 1.0) == (pytest.approx(0.6), "final setting")


def test_the_recipes_fp16_dense_start_costs_its_timed_step_and_the_rest_their_bytes():
    """2 dense steps, 3 fp16 casts (half the bytes), 5 at the final setting: with the benchmark's ``start`` timed,
    each cast costs its step (0.4 s, under the straight line's 0.5 s); without it, the line. The study's rows
    count a run's casts from its step records (half of dense's bytes or more, not all)."""
    from experiments.study_report import _bytes_to, _is_cast

    shares = [1.0] * 2 + [0.5] * 3 + [0.1] * 5
    row = run("topk", [3.0] * 10, shares)
    records = [{"step": i, "bytes_sent": round(b * DENSE_BYTES), "dense_bytes": DENSE_BYTES}
               for i, b in enumerate(shares)]
    row["start_to_eval"] = _bytes_to([r for r in records if _is_cast(r)], list(range(10)), count=True)
    assert row["start_to_eval"][9] == [3, 150, 300] and row["start_to_eval"][1] == [0, 0, 0]
    seconds, model = tta.run_time(row, 9, step_time=0.2, dense_step_time=1.0, start_step_time=0.4)
    assert seconds == pytest.approx(2 * 1.0 + 3 * 0.4 + 5 * 0.2) and model == "per-step bytes, timed casts"
    seconds, model = tta.run_time(row, 9, step_time=0.2, dense_step_time=1.0)
    assert seconds == pytest.approx(2 * 1.0 + 3 * (0.2 + 0.8 * 0.4 / 0.9) + 5 * 0.2) and model == "per-step bytes"
    # rows_for times the casts of the recipes only, with the start's paired ratio to dense
    dense = run("dense", [3.0] * 10, [1.0] * 10)
    times = [timing("dense", "1gbit", 1.0), timing("topk", "1gbit", 0.2), timing("start", "1gbit", 0.4)]
    late = {**row, "evals": [[i, 0.0, 4.0 if i < 9 else 3.0] for i in range(10)]}  # reaches dense's loss at step 9
    (topk_row,) = [r for r in tta.rows_for([late, dense], times) if r["method"] == "topk"]
    assert topk_row["time_model"] == "per-step bytes, timed casts"


def test_rows_files_and_a_method_that_never_reaches_the_target(tmp_path):
    dense = run("dense", [3.0, 2.5, 2.2, 2.0, 1.9, 1.8], [1.0] * 6)
    topk = run("topk", [3.0, 2.6, 2.3, 2.1, 1.95, 1.83], [1.0, 1.0, 0.1, 0.1, 0.1, 0.1])  # 1.83 <= 1.8 x 1.02
    twobit = run("twobit", [3.0, 2.9, 2.8, 2.7, 2.6, 2.5], [1.0] + [0.1] * 5)
    (tmp_path / "study").mkdir()
    (tmp_path / "times").mkdir()
    (tmp_path / "study" / "convergence.json").write_text(json.dumps([dense, topk, twobit]))
    times = [timing("dense", "10mbit", 1.0), timing("topk", "10mbit", 0.25), timing("twobit", "10mbit", 0.2),
             timing("dense", "unshaped", 0.1), timing("topk", "unshaped", 0.12), timing("twobit", "unshaped", 0.11)]
    (tmp_path / "times" / "step_times_w.json").write_text(json.dumps(times))
    assert tta.main(["--convergence", str(tmp_path / "study"), "--step-times", str(tmp_path / "times"),
                     "--out", str(tmp_path / "out")]) == 0
    rows = {(r["method"], r["link"]): r for r in json.loads((tmp_path / "out" / "time_to_accuracy.json").read_text())}
    assert len(rows) == 6
    assert rows[("dense", "10mbit")]["steps_to_target"] == 6  # 1.9 > 1.8 x 1.02: dense's own 6th step
    assert rows[("dense", "10mbit")]["time_ratio_vs_dense"] == pytest.approx(1.0)
    slow = rows[("topk", "10mbit")]
    assert slow["steps_to_target"] == 6
    assert slow["time_ratio_vs_dense"] == pytest.approx((2 * 1.0 + 4 * 0.25) / 6)
    assert rows[("topk", "unshaped")]["time_ratio_vs_dense"] == pytest.approx((2 * 0.1 + 4 * 0.12) / 0.6)
    assert rows[("twobit", "10mbit")]["steps_to_target"] is None
    assert rows[("twobit", "10mbit")]["time_ratio_vs_dense"] is None
    table = (tmp_path / "out" / "time_to_accuracy.md").read_text()
    assert table.count("| never |") == 4 and "0.50x" in table  # steps and ratio, 2 links
    assert (tmp_path / "out" / "w_sgdm_loss_vs_time.png").stat().st_size > 1000


def test_rows_say_whether_dense_ran_on_the_same_machine_and_dense_its_step_over_the_loopback():
    """Seeds 0 and 1 of dense on machine A; top-k's seed 1 on B (marked in both tables), 2-bit's on A (not
    marked), a method whose runs recorded no machine (``None``, not marked)."""
    from experiments import readme_tables

    def on(machine, method, seed):
        row = run(method, [3.0, 2.0, 1.8], [1.0, 0.1, 0.1], seed=seed)
        return {**row, "machine": machine} if machine else row

    convergence = [on("A", "dense", 0), on("A", "dense", 1), on("A", "topk", 0), on("B", "topk", 1),
                   on("A", "twobit", 0), on("A", "twobit", 1), on(None, "threebit", 0), on(None, "threebit", 1)]
    times = [timing(m, link, t * (10 if link == "10mbit" else 1)) for link in ("10mbit", "unshaped")
             for m, t in (("dense", 0.1), ("topk", 0.05), ("twobit", 0.06), ("threebit", 0.06))]
    rows = {(r["method"], r["link"]): r for r in tta.rows_for(convergence, times)}
    assert [rows[(m, "10mbit")]["same_machine_as_dense"] for m in ("dense", "topk", "twobit", "threebit")] == [
        True, False, True, None]
    assert rows[("dense", "10mbit")]["dense_step_over_loopback"] == pytest.approx(10.0)
    assert rows[("dense", "unshaped")]["dense_step_over_loopback"] == pytest.approx(1.0)
    assert "dense_step_over_loopback" not in rows[("topk", "10mbit")]
    table = tta.markdown(list(rows.values()))
    marked = [line for line in table.splitlines() if "(dense: another machine)" in line]
    assert len(marked) == 2 and all("| topk |" in line for line in marked)
    assert "| 10.00 |" in table
    study = readme_tables.study_time_table(list(rows.values()))
    assert study.count(readme_tables.OTHER_MACHINE_MARK) == 3  # two cells and the note
    assert "two machines" in study


def test_the_paired_ratio_sees_through_the_machines_drift_between_rounds():
    """Two rounds on a machine 30 % slower in the second; within a round `auto` takes 1.01x dense's
    step, step by step: the round medians spread 30 %, the paired ratio is 1.01 with no spread, and the
    time to the target counts auto's step as dense's median x 1.01."""
    from argparse import Namespace

    from experiments import step_times

    def rank(extra):  # per key, per round, per step; the slower rank is taken step by step
        dense = [[0.100, 0.104, 0.098], [0.130, 0.135, 0.127]]
        return {"dense|unshaped": dense, "auto|unshaped": [[t * 1.01 + extra for t in r] for r in dense],
                "noop|unshaped": [[0.09] * 3, [0.117] * 3]}

    rows = step_times.summarize([rank(0.0), rank(-0.01)], Namespace(workload="w", optimizer="sgdm", steps=3), 0.2)
    by = {r["method"]: r for r in rows}
    assert by["dense"]["spread"] == pytest.approx((0.130 - 0.100) / 0.115)
    assert by["auto"]["ratio_vs_dense"] == pytest.approx(1.01) and by["auto"]["ratio_spread"] == pytest.approx(0)
    assert "ratio_vs_dense" not in by["dense"]
    assert by["dense"]["dense_step_over_compute"] == pytest.approx(0.115 / 0.1035)
    dense, auto = timing("dense", "unshaped", 0.115), {**timing("auto", "unshaped", 0.2), "ratio_vs_dense": 1.01}
    assert tta.paired_step_time(auto, dense) == pytest.approx(0.115 * 1.01)
    assert tta.paired_step_time(timing("auto", "unshaped", 0.2), dense) == 0.2  # no pairs: its own median


def test_horovod_rounds_are_summarized_as_ddps_step_by_step_and_marked_as_horovods():
    from types import SimpleNamespace

    from experiments import horovod_step_times

    # Two ranks; the slower rank's step counts, step by step. Round 1 ran on a slower machine.
    fast = {"noop|10mbit": [[0.1, 0.1, 0.1], [0.1, 0.1, 0.1]], "dense|10mbit": [[2.0, 2.2, 2.1], [3.0, 3.0, 3.1]],
            "topk|10mbit": [[0.2, 0.2, 0.3], [0.3, 0.3, 0.3]]}
    slow = {**fast, "dense|10mbit": [[2.3, 2.4, 1.0], [3.0, 3.0, 3.1]],
            "topk|10mbit": [[0.2, 0.2, 0.4], [0.3, 0.3, 0.3]]}
    args = SimpleNamespace(workload="w", optimizer="adamw")
    rows = {r["method"]: r for r in horovod_step_times.summarize([fast, slow], args, 0.3)}
    assert rows["dense"]["rounds"] == [2.3, 3.0] and rows["dense"]["step_time"] == pytest.approx(2.65)
    assert rows["dense"]["spread"] == pytest.approx(0.7 / 2.65) and "ratio_vs_dense" not in rows["dense"]
    assert rows["dense"]["dense_step_over_compute"] == pytest.approx(26.5)
    assert rows["topk"]["ratio_rounds"] == pytest.approx([0.2 / 2.3, 0.1])  # steps paired with dense's
    assert rows["topk"]["ratio_vs_dense"] == pytest.approx((0.2 / 2.3 + 0.1) / 2)
    assert all(r["integration"] == "horovod" and r["link_mode"] == "shared" and r["load_before"] == 0.3
               and r["steps_per_round"] == 3 for r in rows.values())


@pytest.mark.multiprocess
@pytest.mark.horovod
@pytest.mark.slow
@pytest.mark.skipif(netem.shaping_unavailable_reason() is not None,
                    reason=f"the Horovod step times change an emulated link: {netem.shaping_unavailable_reason()}")
def test_the_study_under_horovod_runs_the_recipe_and_its_step_times_feed_the_time_to_accuracy(tmp_path):
    # Real horovodrun ranks: `convergence --parallel horovod` logs the study's records (the recipe's plan in
    # the config), the study's aggregation reads them, and `horovod_step_times` times the same methods.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    study = subprocess.run([sys.executable, "-m", "experiments.convergence", "--parallel", "horovod", "--workloads",
                            "charlm-tiny", "--optimizers", "adamw", "--methods", "dense,topk,twobit", "--steps", "12",
                            "--seeds", "0", "--out", str(tmp_path / "conv"), "--run-timeout", "300"],
                           capture_output=True, text=True, timeout=1000, env=env, cwd=root)
    assert study.returncode == 0, study.stdout[-3000:] + study.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "conv" / "convergence.json").read_text())}
    assert set(rows) == {"dense", "topk", "twobit"}
    assert all(r["parallel"] == "horovod" and r["engine"] == "horovod" and len(r["evals"]) == 12 for r in rows.values())
    assert rows["dense"]["compression"] == pytest.approx(1.0) and rows["topk"]["compression"] > 1.0
    assert rows["twobit"]["final_bytes_share"] < 1.0 and rows["topk"]["gap_to_dense"] is not None
    config = next(json.loads(line) for line in open(rows["topk"]["log"]) if '"config"' in line)
    assert config["recipe"].startswith("TopK(") and config["world_size"] == 2
    timed = subprocess.run([sys.executable, "-m", "experiments.horovod_step_times", "--workload", "charlm-tiny",
                            "--links", "unshaped,100mbit", "--rounds", "2", "--steps", "3", "--settle", "1",
                            "--run-steps", "12", "--out", str(tmp_path / "times")],
                           capture_output=True, text=True, timeout=1000, env=env, cwd=root)
    assert timed.returncode == 0, timed.stdout[-3000:] + timed.stderr[-3000:]
    times = json.loads((tmp_path / "times" / "step_times_charlm-tiny_adamw.json").read_text())
    methods = ("noop", "dense", "fp16", "topk", "twobit", "start")
    assert {(r["method"], r["link"]) for r in times} == {(m, link) for m in methods for link in ("unshaped", "100mbit")}
    assert all(len(r["rounds"]) == 2 and r["step_time"] > 0 and r["integration"] == "horovod" for r in times)
    steps = {(r["method"], r["link"]): r["step_time"] for r in times}  # the link changed between rounds
    assert steps[("dense", "100mbit")] > 1.5 * steps[("dense", "unshaped")]
    result = tta.rows_for(list(rows.values()), times)
    assert {r["method"] for r in result} == {"dense", "topk", "twobit"}
    assert next(r for r in result if r["method"] == "dense")["steps_to_target"] is not None


def test_a_benchmark_planned_short_times_the_2_bit_code_of_the_run_it_stands_for():
    # The step-time benchmarks plan the recipe for a few steps to reach its final setting; the 2-bit
    # code depends on the run's length under Adam (3-bit's dense start must leave Adam's variance its
    # samples), so they time the code of the study's run: charlm-small under AdamW runs 3-bit over the
    # study's 2000 steps and the ternary code over the main job's 200, under SGD 3-bit either way.
    import torch

    from experiments import suite
    from experiments.methods import study_spec

    model = suite.build("charlm-small", 0, 8).build_model()
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert study_spec("twobit", model, adamw, 2000) == "threebit"
    assert study_spec("twobit", model, adamw, 200) == "twobit:chunk"
    assert study_spec("twobit", model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 200) == "threebit"
    assert study_spec("topk", model, adamw, 200) == "topk:0.01" and not adamw.state


def test_with_several_seeds_each_seed_meets_its_own_dense_and_the_row_is_the_upper_median():
    # Seed 0 reaches its dense run's target, seeds 1 and 2 never do: the cell never reaches it.
    runs = [run("dense", [3.0, 2.0], [1.0, 1.0], seed) for seed in (0, 1, 2)]
    runs += [run("twobit", [3.0, 2.0], [1.0, 0.1], 0), run("twobit", [3.0, 2.1], [1.0, 0.1], 1),
             run("twobit", [3.0, 2.2], [1.0, 0.1], 2)]
    times = [timing("dense", "10mbit", 1.0), timing("twobit", "10mbit", 0.1)]
    (row,) = [r for r in tta.rows_for(runs, times) if r["method"] == "twobit"]
    assert row["seeds"] == [0, 1, 2] and row["time_ratio_by_seed"][1:] == [None, None]
    assert row["time_ratio_by_seed"][0] == pytest.approx((1.0 + 0.1) / 2.0)
    assert row["time_ratio_vs_dense"] is None and row["steps_to_target"] is None
    runs[-1] = run("twobit", [3.0, 1.9], [1.0, 0.1], 2)  # two seeds of three reach it: the upper median does
    (row,) = [r for r in tta.rows_for(runs, times) if r["method"] == "twobit"]
    assert row["time_ratio_vs_dense"] == pytest.approx(0.55) and row["steps_to_target"] == 2


def test_rounds_on_a_short_step_run_as_many_steps_as_fill_the_round_and_never_fewer_than_asked():
    from experiments import step_times

    assert step_times.round_steps(0.020, 2.0, 6) == 100  # 4 methods of 5 ms: 100 cycles fill 2 s
    assert step_times.round_steps(1.5, 2.0, 6) == 6  # a slow link keeps the minimum
    assert step_times.round_steps(1e-6, 2.0, 6) == step_times.MAX_ROUND_STEPS
    assert step_times.round_steps(0.0, 2.0, 6) == step_times.MAX_ROUND_STEPS
    assert step_times.round_steps(0.020, 0.0, 6) == 6  # no round time asked: the fixed count


def test_a_later_step_times_directory_adds_only_the_methods_the_earlier_lack(tmp_path):
    first, second = tmp_path / "all", tmp_path / "start"
    first.mkdir(), second.mkdir()
    (first / "step_times_w_sgdm.json").write_text(json.dumps([timing("dense", "1gbit", 1.0),
                                                              timing("topk", "1gbit", 0.2)]))
    (second / "step_times_w_sgdm.json").write_text(json.dumps([timing("dense", "1gbit", 1.5),
                                                               timing("start", "1gbit", 0.6)]))
    rows = tta.read_step_times([str(first), str(second)])
    assert sorted((r["method"], r["step_time"]) for r in rows) == [("dense", 1.0), ("start", 0.6), ("topk", 0.2)]


def test_a_classifier_row_also_gives_the_time_to_dense_accuracy_less_half_a_point():
    """Rows whose runs record accuracy by evaluation: the step at which accuracy first reaches dense's final less
    ACCURACY_TOLERANCE, timed as the loss's, over dense's time to its own final accuracy; a run whose loss never
    reaches the loss target can reach the accuracy one. Rows without accuracy carry None."""
    dense = run("dense", [3.0, 2.0, 1.0, 0.5], [1.0] * 4)
    topk = run("topk", [3.0, 2.0, 1.5, 0.9], [1.0, 0.1, 0.1, 0.1])  # loss: never within 2 % of 0.5
    dense["eval_accuracy"], dense["final_accuracy"] = [0.5, 0.9, 0.99, 0.99], 0.99
    topk["eval_accuracy"] = [0.5, 0.8, 0.986, 0.99]  # 0.986 >= 0.99 - 0.005 at evaluation 2
    times = [timing("dense", "10mbit", 1.0), timing("topk", "10mbit", 0.2)]
    (row,) = [r for r in tta.rows_for([dense, topk], times) if r["method"] == "topk"]
    assert tta.ACCURACY_TOLERANCE == 0.005 and row["accuracy_target"] == pytest.approx(0.985)
    assert row["time_ratio_vs_dense"] is None and row["steps_to_accuracy"] == 3
    # topk: one dense step then two at the final setting; dense reaches its own final accuracy at evaluation 2
    assert row["accuracy_time_ratio_vs_dense"] == pytest.approx((1.0 + 2 * 0.2) / 3.0)
    (own,) = [r for r in tta.rows_for([dense, topk], times) if r["method"] == "dense"]
    assert own["accuracy_time_ratio_vs_dense"] == pytest.approx(1.0)
    assert "| 0.47x |" in tta.markdown([row])
    topk["eval_accuracy"] = [0.5, 0.8, 0.98, 0.984]  # never within half a point
    (row,) = [r for r in tta.rows_for([dense, topk], times) if r["method"] == "topk"]
    assert row["steps_to_accuracy"] is None and row["accuracy_time_ratio_vs_dense"] is None
    del dense["eval_accuracy"], topk["eval_accuracy"]
    assert all(r["accuracy_target"] is None for r in tta.rows_for([dense, topk], times))
