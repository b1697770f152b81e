"""The rate screens' held-out evaluations in one file, and their table against the study's rows at the study's rate.

Usage, from the repository root: ``python experiments/results/research-tuned-dense/summarize.py LOGDIR`` (the
``screen_rate.py`` logs, named ``WORKLOAD__OPTIMIZER__METHOD__xSCALE__sSEED.jsonl``); writes ``screens.json``
beside this file (per run: its final evaluation and every evaluation as ``[step, loss, accuracy]``) and prints the
table (each seed screened; the 1x row is the study's row, ``experiments/results/convergence/convergence.json``).
"""
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STUDY = os.path.join(HERE, "..", "convergence", "convergence.json")


def read(path: str) -> dict:
    workload, optimizer, method, scale, seed = re.match(
        r"(.+)__(.+)__(.+)__x(.+)__s(\d+)\.jsonl", os.path.basename(path)).groups()
    records = [json.loads(line) for line in open(path)]
    evals = [[r["step"], r["eval_loss"], r.get("accuracy")] for r in records if r.get("event") == "eval"]
    done = any(r.get("event") == "done" for r in records)
    return {"workload": workload, "optimizer": optimizer, "method": method, "scale": float(scale),
            "seed": int(seed), "done": done, "final": evals[-1] if evals else None, "evals": evals}


def cell(run, dense) -> str:
    """A run's end, and against the dense run at the same rate where there is one."""
    step, loss, accuracy = run["final"]
    text = f"{loss:.4f}" + (f" ({accuracy:.4f})" if accuracy is not None else "")
    if dense is not None and run is not dense:
        text += f", {loss / dense['final'][1] - 1:+.1%}"
    return text if run["done"] else text + f" (at step {step})"


def main(logdir: str) -> None:
    runs = [read(path) for path in sorted(glob.glob(os.path.join(logdir, "*.jsonl")))]
    runs = [run for run in runs if run["final"] is not None]
    with open(os.path.join(HERE, "screens.json"), "w") as f:
        json.dump(runs, f, indent=0)
    study = {(r["workload"], r["optimizer"], r["method"], r["seed"]): r for r in json.load(open(STUDY))}
    by = {(r["workload"], r["optimizer"], r["method"], r["scale"], r["seed"]): r for r in runs}
    print("| workload | optimizer | seed | scale | dense | top-k vs dense | 2-bit vs dense |")
    print("|---|---|---|---|---|---|---|")
    for workload, optimizer, seed in sorted({(r["workload"], r["optimizer"], r["seed"]) for r in runs}):
        rows = {1.0: {m: study.get((workload, optimizer, m, seed)) for m in ("dense", "topk", "twobit")}}
        for scale in sorted({r["scale"] for r in runs if (r["workload"], r["optimizer"], r["seed"]) ==
                             (workload, optimizer, seed)}):
            rows[scale] = {m: by.get((workload, optimizer, m, scale, seed)) for m in ("dense", "topk", "twobit")}
        for scale, methods in sorted(rows.items()):
            if scale == 1.0:  # the study's rows, in the same shape
                methods = {m: None if r is None else {"final": [0, r["final_loss"], r.get("final_accuracy")],
                                                      "done": True} for m, r in methods.items()}
            if all(run is None for run in methods.values()):
                continue
            dense = methods["dense"]
            cells = [("–" if methods[m] is None else cell(methods[m], dense)) for m in ("dense", "topk", "twobit")]
            print(f"| {workload} | {optimizer} | {seed} | {scale:g}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
