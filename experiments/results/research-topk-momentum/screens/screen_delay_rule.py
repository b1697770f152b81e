"""The study's SGD-momentum top-k run with another rule for the delay the stage gives up per density.

``RULE``: ``density`` (the recipe's: ``DELAY_STEPS * log(1/rho) / log(100)``, at most ``DELAY_STEPS``),
``flat`` (``DELAY_STEPS`` at every density below 1), or ``half`` (the log rule from ``DELAY_STEPS / 2``
at density 1/8: ``max(rule, DELAY_STEPS / 2)``, so the ramp's first stages give up more), or ``sqrt``
(``DELAY_STEPS * sqrt(log(1/rho) / log(100))``, at most ``DELAY_STEPS``: 3.4 steps at 1/8, 3.9 at 1/16).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_delay_rule.py RULE WORKLOAD SEED LOG``
"""
import math
import sys

import torch

from experiments.screening import run_prefix
from experiments.suite import STEPS
from gradcomp.optim import delayed_momentum

RECIPE = delayed_momentum.delay_at


def rule(name: str):
    if name == "density":
        return RECIPE
    if name == "flat":
        return lambda density, steps=delayed_momentum.DELAY_STEPS: steps if 0 < density < 1 else 0.0
    if name == "half":
        return lambda density, steps=delayed_momentum.DELAY_STEPS: (
            max(RECIPE(density, steps), steps / 2) if 0 < density < 1 else 0.0)
    if name == "sqrt":
        return lambda density, steps=delayed_momentum.DELAY_STEPS: (
            steps * math.sqrt(RECIPE(density, steps) / steps) if 0 < density < 1 else 0.0)
    raise SystemExit(f"unknown rule {name}")


def main(name: str, workload: str, seed: int, log: str) -> None:
    torch.set_num_threads(1)
    delayed_momentum.delay_at = rule(name)
    run_prefix(STEPS[workload], log, workload, "sgdm", "topk", seed)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
