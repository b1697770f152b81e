"""The top-k ramp's longest length, where it binds: the study's top-k run (its loop, length and seed) at
a density below the recipe's (``DENSITY``, e.g. ``0.0025`` for ``"topk:0.0025"``) with
:data:`gradcomp.recipe.RAMP_FRACTION` set to ``FRACTION`` (the recipe's 0.75 was never measured). At the
study's ``"topk:0.01"`` the 8x byte budget ends the ramp first on every workload (under SGD-momentum
4 x 140 of the GPT's 950 steps after the dense start, 0.59); below it the budget affords more, and the
cap decides how many steps run at the final density and how far past 8x the run ends.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-ramp/screens/screen_cap.py FRACTION LOG WORKLOAD DENSITY
[OPTIMIZER [SEED]]`` (SGD-momentum and seed 0 unless named); the run goes to its end.
"""
import sys

import torch

from experiments import simrun
from experiments.screening import run_prefix
from experiments.suite import STEPS
from gradcomp import recipe


def main(fraction: str, log: str, workload: str, density: str, optimizer: str = "sgdm", seed: str = "0") -> None:
    torch.set_num_threads(1)
    recipe.RAMP_FRACTION = float(fraction)
    simrun.SPECS["topk"] = f"topk:{density}"
    run_prefix(STEPS[workload], log, workload, optimizer, "topk", int(seed))


if __name__ == "__main__":
    main(*sys.argv[1:])
