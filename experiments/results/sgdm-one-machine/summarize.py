"""The study's SGD-momentum dense and top-k rows made on one machine (``convergence.json`` here): the README's
convergence table for them (:func:`experiments.readme_tables.convergence_table`, a cell the median of its seeds'
gaps) and each seed's final held-out loss (and accuracy) against dense's of the same seed.

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/sgdm-one-machine/summarize.py``.
"""
import json
import os

from experiments.readme_tables import convergence_table

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    rows = json.load(open(os.path.join(HERE, "convergence.json")))
    machines = sorted({row["machine"] for row in rows})
    print(f"machines: {', '.join(machines)}; {len(rows)} runs\n")
    print(convergence_table(rows))
    dense = {(r["workload"], r["seed"]): r for r in rows if r["method"] == "dense"}
    print("| workload | seed | dense: held-out loss (accuracy) | top-k | top-k vs dense: loss (accuracy points) |")
    print("|---|---|---|---|---|")
    for row in sorted((r for r in rows if r["method"] != "dense"), key=lambda r: (r["workload"], r["seed"])):
        base = dense[(row["workload"], row["seed"])]
        shown = [f"{r['final_loss']:.4f}" for r in (base, row)]
        gap = f"{row['final_loss'] / base['final_loss'] - 1:+.1%}"
        if row.get("final_accuracy") is not None and base.get("final_accuracy") is not None:
            shown = [f"{text} ({r['final_accuracy']:.4f})" for text, r in zip(shown, (base, row))]
            gap += f" ({(row['final_accuracy'] - base['final_accuracy']) * 100:+.2f})"
        print(f"| {row['workload']} | {row['seed']} | {shown[0]} | {shown[1]} | {gap} |")


if __name__ == "__main__":
    main()
