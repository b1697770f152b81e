"""Shapes under SGD-momentum, seed by seed: does each method's held-out loss reach dense's final x 1.02?

Usage, from the repository root: ``python experiments/results/research-shapes-sgd-seeds/summarize.py``. Reads the
study's rows (``experiments/results/convergence/convergence.json``, seeds 0-2) and this directory's
(``convergence.json``: more seeds, and torch's fp16 hook as a control), and prints one row per seed: dense's final
held-out loss and accuracy and how far its own last five evaluations spread; per method its final loss against
dense's, its best evaluation, and the first step it reaches the time-to-accuracy target (``never`` if none). Then
where the runs part from dense: per seed and method, the median ratio of its held-out loss to dense's at the same
evaluation, in windows of :data:`WINDOW` evaluations.
"""
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = (os.path.join(HERE, "convergence.json"),)
METHODS = ("topk", "twobit", "fp16")
#: The time-to-accuracy target: dense's final held-out loss times this (experiments.time_to_accuracy).
TARGET = 1.02
#: Evaluations per window of the second table (the study evaluates every 12 steps: 120 steps a window).
WINDOW = 10


def rows() -> dict:
    """``(seed, method) -> row`` of shapes under SGD-momentum; this directory's rows win over the study's."""
    found = {}
    for path in SOURCES:
        for row in json.load(open(path)):
            if row["workload"] == "shapes" and row["optimizer"] == "sgdm":
                found[(row["seed"], row["method"])] = row
    return found


def reached(row: dict, target: float):
    """The first evaluation step at which ``row``'s held-out loss is at most ``target`` (None: never)."""
    return next((step for step, _, loss in row["evals"] if loss <= target), None)


def settled(row: dict, count: int = WINDOW) -> float:
    """The median of ``row``'s last ``count`` held-out losses: its level at the end of the run, which one
    evaluation at a loss of 0.01 (a few confident errors) does not give."""
    return statistics.median([loss for step, _, loss in row["evals"] if step >= 0][-count:])


def main() -> None:
    found = rows()
    print("| seed | dense: final loss (accuracy), last 5 evals' range | " + " | ".join(
        f"{m}: final vs dense, best eval, step reaching x{TARGET}" for m in METHODS) + " |")
    print("|---|---|" + "---|" * len(METHODS))
    gaps = {m: [] for m in METHODS}
    for seed in sorted({seed for seed, method in found if method == "dense"}):
        dense = found[(seed, "dense")]
        last = [loss for _, _, loss in dense["evals"][-5:]]
        spread = (max(last) - min(last)) / statistics.median(last)
        cells = [f"{dense['final_loss']:.4f} ({dense['final_accuracy']:.4f}), {spread:.0%}"]
        for method in METHODS:
            row = found.get((seed, method))
            if row is None:
                cells.append("–")
                continue
            gap = row["final_loss"] / dense["final_loss"] - 1
            gaps[method].append(gap)
            best = min(loss for _, _, loss in row["evals"])
            step = reached(row, dense["final_loss"] * TARGET)
            cells.append(f"{gap:+.1%}, {best:.4f}, {'never' if step is None else step}")
        print(f"| {seed} | " + " | ".join(cells) + " |")
    print("\nmedian final loss against dense: " + ", ".join(
        f"{m} {statistics.median(g):+.1%} ({len(g)} seeds)" for m, g in gaps.items() if g))
    windows(found)


def windows(found: dict) -> None:
    """Per seed and method, the median of held-out loss / dense's at the same evaluation, window by window."""
    dense_evals = {seed: row["evals"] for (seed, method), row in found.items() if method == "dense"}
    count = min(len(evals) for evals in dense_evals.values()) // WINDOW
    steps = [dense_evals[min(dense_evals)][i * WINDOW][0] for i in range(count)]
    print("\n| seed | method | " + " | ".join(f"from step {step}" for step in steps) + " |")
    print("|---|---|" + "---|" * count)
    for seed in sorted(dense_evals):
        for method in METHODS:
            row = found.get((seed, method))
            if row is None:
                continue
            ratios = [loss / dense[2] for (_, _, loss), dense in zip(row["evals"], dense_evals[seed])]
            medians = [statistics.median(ratios[i * WINDOW:(i + 1) * WINDOW]) for i in range(count)]
            print(f"| {seed} | {method} | " + " | ".join(f"{m:.2f}" for m in medians) + " |")


if __name__ == "__main__":
    main()
