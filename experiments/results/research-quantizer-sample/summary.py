"""Summarize screen.sh's runs: ``python summary.py OUT`` prints, per cell and sample, each seed's final held-out
loss against dense's (and the classifiers' accuracy), and on cells of several seeds the best held-out loss of the
run against dense's best and the step it came at; writes ``OUT/summary.json``."""
import glob
import json
import os
import statistics
import sys


def runs(path):
    return {row["seed"]: row for row in json.load(open(path))}


def summarize(out):
    cells = {}
    for path in sorted(glob.glob(os.path.join(out, "*-*/convergence.json"))):
        tag, mode = os.path.basename(os.path.dirname(path)).rsplit("-", 1)
        cells.setdefault(tag, {})[mode] = runs(path)
    summary = {}
    for tag, modes in cells.items():
        dense = modes.pop("dense")
        for mode, rows in sorted(modes.items()):
            seeds = []
            for seed, row in sorted(rows.items()):
                best = min(row["evals"], key=lambda e: e[2])
                dense_best = min(e[2] for e in dense[seed]["evals"])
                seeds.append({"seed": seed, "final_gap": row["final_loss"] / dense[seed]["final_loss"] - 1,
                              "best_gap": best[2] / dense_best - 1, "best_step": best[0],
                              "accuracy": row.get("final_accuracy"),
                              "dense_accuracy": dense[seed].get("final_accuracy")})
            summary.setdefault(tag, {})[mode] = seeds
    return summary


def main():
    out = sys.argv[1]
    summary = summarize(out)
    json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
    print("| cell | sample | final held-out loss vs dense, each seed | median | best vs dense's best (median) "
          "| step of the best (median) |\n|---|---|---|---|---|---|")
    for tag, modes in summary.items():
        for mode, seeds in modes.items():
            finals = [s["final_gap"] for s in seeds]
            cells = " / ".join(f"{100 * g:+.1f} %" for g in finals)
            best = f"{100 * statistics.median(s['best_gap'] for s in seeds):+.1f} %" if len(seeds) > 1 else ""
            step = f"{statistics.median(s['best_step'] for s in seeds):.0f}" if len(seeds) > 1 else ""
            print(f"| {tag} | {mode} | {cells} | {100 * statistics.median(finals):+.1f} % | {best} | {step} |")


if __name__ == "__main__":
    main()
