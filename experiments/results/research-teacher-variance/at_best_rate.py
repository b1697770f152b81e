"""The recipe with its variance refreshed, at dense's best learning rate: the rate screens' ends against dense's.

Usage, from the repository root: ``python experiments/results/research-teacher-variance/at_best_rate.py LOGDIR``;
``LOGDIR`` holds ``experiments/results/research-tuned-dense/screen_rate.py`` logs named
``WORKLOAD_OPTIMIZER_METHOD_SCALEx.jsonl`` (seed 0). Dense's runs at the same rate are the tuned-dense screen's own
(``../research-tuned-dense/screens.json``: dense does not run gradcomp's stage). Writes ``at_best_rate.json`` beside
this file (each run's final evaluation) and prints the table.
"""
import glob
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DENSE = os.path.join(HERE, "..", "research-tuned-dense", "screens.json")


def final(path: str):
    """``[step, held-out loss, accuracy or None]`` of a log's last evaluation."""
    evals = [json.loads(line) for line in open(path)]
    last = [r for r in evals if r.get("event") == "eval"][-1]
    return [last["step"], last["eval_loss"], last.get("accuracy")]


def main(logdir: str) -> None:
    dense = {(r["workload"], r["optimizer"], r["scale"]): r["final"] for r in json.load(open(DENSE))
             if r["method"] == "dense" and r["seed"] == 0}
    rows = []
    for path in sorted(glob.glob(os.path.join(logdir, "*.jsonl"))):
        workload, optimizer, method, scale = re.match(r"(.+)_(.+)_(.+)_(.+)x\.jsonl", os.path.basename(path)).groups()
        rows.append({"workload": workload, "optimizer": optimizer, "method": method, "scale": float(scale),
                     "seed": 0, "final": final(path), "dense": dense[(workload, optimizer, float(scale))]})
    with open(os.path.join(HERE, "at_best_rate.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("| workload | scale | method | dense | the recipe | against dense |\n|---|---|---|---|---|---|")
    for r in rows:
        accuracy = lambda end: f" ({end[2]:.4f})" if end[2] is not None else ""  # noqa: E731
        print(f"| {r['workload']} | {r['scale']:g}x | {r['method']} | {r['dense'][1]:.4f}{accuracy(r['dense'])} | "
              f"{r['final'][1]:.4f}{accuracy(r['final'])} | {r['final'][1] / r['dense'][1] - 1:+.1%} |")


if __name__ == "__main__":
    main(sys.argv[1])
