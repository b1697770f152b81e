"""Each probe of a directory (``NAME.json``, the convergence study's rows) against dense and the recipe of the same
workload and seed, all made on one machine (``here.json``): per workload, how many seeds reach dense's final held-out
loss x 1.02, and the medians of the final loss and of the last ten evaluations' median against dense's.

Usage, from the repository root: ``PYTHONPATH=experiments/results/research-shapes-sgd-seeds python
experiments/results/research-shapes-sgd-seeds/ramp-only/compare.py [DIRECTORY]`` (the parent directory's
``summarize`` helpers; DIRECTORY defaults to this one's).
"""
import glob
import json
import os
import statistics
import sys

from summarize import TARGET, reached, settled

HERE = os.path.dirname(os.path.abspath(__file__))


def main(directory: str = HERE) -> None:
    base = {(r["workload"], r["seed"], r["method"]): r for r in json.load(open(os.path.join(directory, "here.json")))}
    probes = [("recipe", [r for r in base.values() if r["method"] == "topk"])]
    probes += [(os.path.basename(p)[:-5], json.load(open(p))) for p in sorted(glob.glob(os.path.join(directory, "*.json")))
               if not p.endswith("here.json")]
    print(f"| run | workload | seeds reaching dense x {TARGET} | final loss vs dense, median | last ten evaluations vs "
          "dense's, median | final loss vs dense, by seed |")
    print("|---|---|---|---|---|---|")
    for name, rows in probes:
        for workload in sorted({r["workload"] for r in rows}):
            members = sorted((r for r in rows if r["workload"] == workload), key=lambda r: r["seed"])
            dense = [base[(workload, r["seed"], "dense")] for r in members]
            hits = sum(reached(r, d["final_loss"] * TARGET) is not None for r, d in zip(members, dense))
            finals = [r["final_loss"] / d["final_loss"] - 1 for r, d in zip(members, dense)]
            level = statistics.median(settled(r) / settled(d) - 1 for r, d in zip(members, dense))
            seeds = ", ".join(f"{r['seed']}: {f:+.1%}" for r, f in zip(members, finals))
            print(f"| {name} | {workload} | {hits} of {len(members)} | {statistics.median(finals):+.1%} | "
                  f"{level:+.1%} | {seeds} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
