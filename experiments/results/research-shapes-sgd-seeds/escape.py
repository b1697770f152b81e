"""Mean training loss in windows of 12 steps, one column per run log (the convergence study's ``runs/*.jsonl``).

Usage: ``python experiments/results/research-shapes-sgd-seeds/escape.py NAME=LOG [NAME=LOG ...] [--from A --to B]``;
prints the table (steps ``A`` to ``B``, default 30 to 270).
"""
import argparse
import json
import statistics

WINDOW = 12


def losses(path: str) -> dict:
    """``step -> training loss`` of one run's log."""
    return {r["step"]: r["loss"] for r in map(json.loads, open(path)) if r.get("event") == "step"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=LOG")
    parser.add_argument("--from", dest="first", type=int, default=30)
    parser.add_argument("--to", dest="last", type=int, default=270)
    args = parser.parse_args()
    runs = {name: losses(path) for name, path in (run.split("=", 1) for run in args.runs)}
    print("| steps | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for lo in range(args.first, args.last, WINDOW):
        means = [statistics.mean(run[s] for s in range(lo, lo + WINDOW)) for run in runs.values()]
        print(f"| {lo}-{lo + WINDOW - 1} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


if __name__ == "__main__":
    main()
