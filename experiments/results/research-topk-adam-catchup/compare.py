"""Held-out loss of research runs against a dense reference, at chosen evals, and the step each first reaches
dense's final loss x 1.02: ``python compare.py DENSE.json RUN...``, each RUN a ``convergence.json`` or a directory
holding one."""
import json
import os
import sys


def evals(row):
    return {step: loss for step, _, loss in row["evals"]}


def main(dense_path, *dirs):
    dense_rows = [r for r in json.load(open(dense_path)) if r["method"] == "dense"]
    for run_dir in dirs:
        path = os.path.join(run_dir, "convergence.json") if os.path.isdir(run_dir) else run_dir
        for row in json.load(open(path)):
            ref = next(r for r in dense_rows if (r["workload"], r["optimizer"], r["seed"], r["steps"]) ==
                       (row["workload"], row["optimizer"], row["seed"], row["steps"]))
            dense, own = evals(ref), evals(row)
            target = ref["final_loss"] * 1.02
            reached = next((s for s in sorted(own) if own[s] <= target), None)
            dense_reached = next((s for s in sorted(dense) if dense[s] <= target), None)
            marks = sorted(dense)[4::max(1, len(dense) // 10)] + [max(dense)]
            cells = " ".join(f"{s}:{(own[s] / dense[s] - 1) * 100:+.1f}" for s in marks if s in own)
            print(f"{run_dir} {row['workload']} {row['method']} s{row['seed']}: final {row['final_loss']:.4f} "
                  f"({(row['final_loss'] / ref['final_loss'] - 1) * 100:+.2f} %), target at {reached} "
                  f"(dense {dense_reached}) | {cells}")


if __name__ == "__main__":
    main(*sys.argv[1:])
