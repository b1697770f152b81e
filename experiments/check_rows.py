"""Are the study's committed rows the output of the code at HEAD? Run some of them again and compare.

A row of ``convergence.json`` records the code that made it (:mod:`experiments.fingerprint`), but any
commit to the run's modules changes that hash, numerics or not, so the hash alone cannot say whether a
row is still what its command gives. This runs the chosen rows again (the study's own command, into a
scratch directory) and compares every held-out evaluation bit for bit: a row is ``current`` when all
match, ``stale`` from the first that differs. The cheapest workload (digits-mlp, seconds a run) checks
every optimizer and method's code path; a stale row there says the study wants running again.

Usage::

    python -m experiments.check_rows --study experiments/results/convergence --workloads digits-mlp

Exit status 1 when a row is stale or missing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Tuple

__all__ = ["compare", "main"]

Key = Tuple[str, str, str, int]


def _rows(path: str) -> Dict[Key, dict]:
    with open(path) as f:
        return {(r["workload"], r["optimizer"], r["method"], r["seed"]): r for r in json.load(f)}


def compare(committed: dict, fresh: dict) -> str:
    """``"current"`` when every evaluation (``[step, time, held-out loss]``, the loss compared) is equal,
    else ``"stale from step S: A (committed) vs B (now)"``."""
    old, new = committed["evals"], fresh["evals"]
    for (step, _, a), (_, _, b) in zip(old, new):
        if a != b:
            return f"stale from step {step}: {a!r} (committed) vs {b!r} (now)"
    if len(old) != len(new):
        return f"stale: {len(old)} evaluations committed, {len(new)} now"
    return "current"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", default="experiments/results/convergence", help="the study's output directory")
    parser.add_argument("--workloads", default="digits-mlp")
    parser.add_argument("--optimizers", default="adamw,sgdm")
    parser.add_argument("--methods", default="dense,topk,twobit")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    committed = _rows(os.path.join(args.study, "convergence.json"))
    with tempfile.TemporaryDirectory(prefix="gradcomp-check-") as scratch:
        command = [sys.executable, "-m", "experiments.convergence", "--out", scratch, "--workloads", args.workloads,
                   "--optimizers", args.optimizers, "--methods", args.methods, "--seeds", args.seeds,
                   "--jobs", str(args.jobs)]
        subprocess.run(command, check=False, stdout=subprocess.DEVNULL, timeout=3600)
        made = os.path.join(scratch, "convergence.json")
        fresh = _rows(made) if os.path.exists(made) else {}
    if not fresh:
        print("check_rows: the study made no rows", file=sys.stderr)
        return 1
    verdicts: List[str] = []
    for key in sorted(fresh):
        verdict = compare(committed[key], fresh[key]) if key in committed else "missing from the study"
        verdicts.append(verdict)
        print(f"{'/'.join(map(str, key))}: {verdict}")
    return 0 if verdicts and all(v == "current" for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
