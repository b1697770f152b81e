"""Each probe's runs (``probes/NAME.json``, the convergence study's rows) against dense and the recipe of the same seed.

Usage, from the repository root: ``python experiments/results/research-shapes-sgd-seeds/compare_probes.py``.
"""
import glob
import json
import os

from summarize import HERE, TARGET, reached, rows  # (the script's directory is on the path)


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


if __name__ == "__main__":
    main()
