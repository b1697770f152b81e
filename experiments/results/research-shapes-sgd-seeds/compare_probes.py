"""Each probe's runs (``probes/NAME.json``, the convergence study's rows) against dense and the recipe of the same seed;
then per probe and method (the recipes and fp16 as run) over its seeds: how many reach the target, and the medians of
the final held-out loss and of the last ten evaluations' median (:func:`summarize.settled`) against dense's.

Usage, from the repository root: ``python experiments/results/research-shapes-sgd-seeds/compare_probes.py``.
"""
import glob
import json
import os
import statistics

from summarize import HERE, METHODS, TARGET, WINDOW, reached, rows, settled  # (the script's directory is on the path)


def main() -> None:
    base = rows()
    print("| probe | method | seed | final loss vs dense (the recipe's) | step reaching dense x 1.02 | bytes |")
    print("|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(HERE, "probes", "*.json"))):
        for row in sorted(json.load(open(path)), key=lambda r: (r["method"], r["seed"])):
            dense, recipe = base[(row["seed"], "dense")], base[(row["seed"], row["method"])]
            step = reached(row, dense["final_loss"] * TARGET)
            gap, recipe_gap = (r["final_loss"] / dense["final_loss"] - 1 for r in (row, recipe))
            name = os.path.basename(path)[:-5]
            print(f"| {name} | {row['method']} | {row['seed']} | {gap:+.1%} ({recipe_gap:+.1%}) | "
                  f"{'never' if step is None else step} | {row['compression']:.1f}x |")
    overall(base)


def overall(base: dict) -> None:
    """One line per probe and method, and per method of ``base`` (the recipes, fp16) over their seeds."""
    groups = {("(as run)", method): [row for (seed, m), row in base.items() if m == method] for method in METHODS}
    for path in sorted(glob.glob(os.path.join(HERE, "probes", "*.json"))):
        for row in json.load(open(path)):
            groups.setdefault((os.path.basename(path)[:-5], row["method"]), []).append(row)
    print(f"\n| probe | method | seeds reaching dense x {TARGET} | final loss vs dense, median | "
          f"last {WINDOW} evaluations vs dense's, median |")
    print("|---|---|---|---|---|")
    for (name, method), members in groups.items():
        dense = [base[(row["seed"], "dense")] for row in members]
        hits = sum(reached(row, d["final_loss"] * TARGET) is not None for row, d in zip(members, dense))
        final = statistics.median(row["final_loss"] / d["final_loss"] - 1 for row, d in zip(members, dense))
        level = statistics.median(settled(row) / settled(d) - 1 for row, d in zip(members, dense))
        print(f"| {name} | {method} | {hits} of {len(members)} | {final:+.1%} | {level:+.1%} |")


if __name__ == "__main__":
    main()
