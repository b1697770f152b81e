"""The recipe's residual decay for 3-bit under SGD (``gradcomp.recipe.RESIDUAL_DECAY``) set to another
value, 1 being plain error feedback: the study's 2-bit run (3-bit under SGD) of a seed, in the study's
simulation of 2 ranks.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-threebit-adamw/screens/screen_decay.py DECAY SEED STEPS LOG
[WORKLOAD]`` (SGD-momentum; STEPS: where to stop, of the study's run).
"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp import recipe


def main(decay: float, seed: int, stop: int, log: str, workload: str = "charlm-small") -> None:
    torch.set_num_threads(1)
    recipe.RESIDUAL_DECAY = decay
    run_prefix(stop, log, workload, "sgdm", "twobit", seed)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
