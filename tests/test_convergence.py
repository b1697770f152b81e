"""The convergence study's smoke mode: real DDP runs (2 Gloo ranks) end to end, the JSON rows,
the table and the plots."""
import json
import os
import subprocess
import sys

import pytest

from experiments import fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"workload", "optimizer", "method", "seed", "steps", "final_loss", "final_accuracy", "bytes_total",
          "dense_bytes_total", "time_to_dense_loss_s"}


# One study of two ranks per method: minutes on two cores.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def quick_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence")
    command = [sys.executable, "-m", "experiments.convergence", "--out", str(out), "--quick", "--link", "unshaped",
               "--only", "charlm-tiny/sgdm/dense", "--only", "charlm-tiny/sgdm/topk",
               "--only", "charlm-tiny/adamw/twobit", "--run-timeout", "300"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with open(out / "convergence.json") as f:
        return out, json.load(f)


def test_rows_have_the_documented_fields_and_names(quick_study):
    _, rows = quick_study
    assert {(r["optimizer"], r["method"]) for r in rows} == {("sgdm", "dense"), ("sgdm", "topk"), ("adamw", "twobit")}
    for row in rows:
        assert FIELDS <= set(row)
        assert row["optimizer"] in ("adamw", "sgdm")
        assert row["steps"] == 12 and row["final_loss"] > 0 and row["final_accuracy"] is None
        assert row["machine"] == fingerprint.machine()  # the ranks' config record says which machine ran them
    by = {(r["optimizer"], r["method"]): r for r in rows}
    assert by[("sgdm", "topk")]["same_machine_as_dense"] is True
    assert by[("adamw", "twobit")]["same_machine_as_dense"] is None  # no dense run of its cell


def test_bytes_and_dense_comparison(quick_study):
    _, rows = quick_study
    by = {(r["optimizer"], r["method"]): r for r in rows}
    dense, topk = by[("sgdm", "dense")], by[("sgdm", "topk")]
    assert dense["bytes_total"] == dense["dense_bytes_total"] > 0
    # 2 dense steps, then the ramp's 25% stage: top-k sends well under a dense run's bytes.
    assert topk["bytes_total"] < 0.8 * topk["dense_bytes_total"]
    assert topk["dense_bytes_total"] == dense["dense_bytes_total"]
    assert dense["time_to_dense_loss_s"] is not None  # dense reaches its own final loss
    assert by[("adamw", "twobit")]["time_to_dense_loss_s"] is None  # no adamw dense run to compare with
    for row in rows:  # bytes by evaluation, for time on a link: cumulative, ending at the run's totals
        sent = [b[0] for b in row["bytes_to_eval"]]
        assert len(sent) == len(row["evals"]) and sent == sorted(sent)
        assert row["bytes_to_eval"][-1] == [row["bytes_total"], row["dense_bytes_total"]]
    assert by[("sgdm", "dense")]["final_bytes_share"] == 1.0 and by[("sgdm", "topk")]["final_bytes_share"] < 0.8


def test_table_and_plots_are_written(quick_study):
    out, rows = quick_study
    table = (out / "convergence.md").read_text()
    cells, runs = table.split("## Runs")
    assert runs.count("| charlm-tiny |") == len(rows)  # one line per run
    assert cells.count("| charlm-tiny |") == len({(r["optimizer"], r["method"]) for r in rows})  # one per cell
    assert (out / "charlm-tiny_sgdm_loss_vs_step.png").stat().st_size > 1000
    # time on a link is plotted by experiments.time_to_accuracy, not by the step-count study
    assert not (out / "charlm-tiny_sgdm_loss_vs_time.png").exists()


def test_a_committed_row_is_current_only_when_every_evaluation_is_bitwise_the_new_runs():
    from experiments.check_rows import compare

    row = {"evals": [[19, 0.5, 2.25], [39, 1.0, 2.0]]}
    assert compare(row, {"evals": [[19, 0.7, 2.25], [39, 1.3, 2.0]]}) == "current"  # times may differ
    assert compare(row, {"evals": [[19, 0.5, 2.25], [39, 1.0, 2.0000001]]}).startswith("stale from step 39")
    assert compare(row, {"evals": [[19, 0.5, 2.25]]}).startswith("stale: 2 evaluations committed, 1 now")
