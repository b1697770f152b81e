"""The screens' logs (``screen.py``) against the study's dense runs and step times: final quality and time to
dense's quality on each link, by the study's own time model (:mod:`experiments.time_to_accuracy`).

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-adam-dense-start/analyse.py
LOG...`` (each named ``WORKLOAD__OPTIMIZER__topk__sSEED__fFRACTION.jsonl``); prints a table and writes
``screens.json`` (the rows) beside this file.
"""
import glob
import json
import os
import sys

from experiments import time_to_accuracy
from experiments.convergence import RunSpec
from experiments.study_report import summarize

HERE = os.path.dirname(os.path.abspath(__file__))
STUDY = os.path.join(HERE, "..", "convergence", "convergence.json")
STEP_TIMES = os.path.join(HERE, "..", "time_to_accuracy", "step_times")


def main(logs) -> None:
    with open(STUDY) as f:
        study = json.load(f)
    step_times = []
    for path in sorted(glob.glob(os.path.join(STEP_TIMES, "step_times_*.json"))):
        with open(path) as f:
            step_times.extend(json.load(f))
    rows, seen = [], set()
    for log in sorted(logs):
        workload, optimizer, method, seed, fraction = os.path.basename(log)[:-len(".jsonl")].split("__")
        row = summarize(RunSpec(workload, optimizer, method, int(seed[1:]), 0, 0), log)
        if row is None:  # still running
            continue
        dense = [r for r in study if (r["workload"], r["optimizer"], r["method"], r["seed"]) ==
                 (workload, optimizer, "dense", row["seed"])]
        kept = [r for r in study if (r["workload"], r["optimizer"], r["method"], r["seed"]) ==
                (workload, optimizer, "topk", row["seed"])]
        for variant, run in ((fraction, row), ("study", kept[0] if kept else None)):
            if run is None or not dense or (workload, optimizer, row["seed"], variant) in seen:
                continue
            seen.add((workload, optimizer, row["seed"], variant))
            timed = time_to_accuracy.rows_for(dense + [dict(run, method="topk")], step_times)
            rows.append({"workload": workload, "optimizer": optimizer, "seed": row["seed"], "dense_start": variant,
                         "final_loss": run["final_loss"], "dense_loss": dense[0]["final_loss"],
                         "final_accuracy": run.get("final_accuracy"), "dense_accuracy": dense[0].get("final_accuracy"),
                         "compression": run["compression"],
                         "time_ratio": {r["link"]: r["time_ratio_vs_dense"] for r in timed if r["method"] == "topk"}})
    with open(os.path.join(HERE, "screens.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        ratios = " ".join(f"{link} {'never' if v is None else f'{v:.3f}'}"
                          for link, v in sorted(r["time_ratio"].items()))
        accuracy = "" if r["final_accuracy"] is None else f" acc {r['final_accuracy']:.4f}/{r['dense_accuracy']:.4f}"
        print(f"{r['workload']} {r['optimizer']} s{r['seed']} {r['dense_start']:>6}: loss {r['final_loss']:.4f} "
              f"({r['final_loss'] / r['dense_loss'] - 1:+.1%}){accuracy} {r['compression']:.2f}x | {ratios}")


if __name__ == "__main__":
    main(sys.argv[1:])
