"""The study's top-k run with the recipe's dense start (under Adam, the freeze of its variance) at a
given share of the run: ``gradcomp.recipe.DENSE_FRACTION`` and ``ADAM_DENSE_FRACTION`` both set to
``FRACTION`` (the byte budget still caps it).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-adam-bound/screens/screen_freeze.py FRACTION WORKLOAD SEED LOG
[OPTIMIZER]`` (AdamW unless named; ``sgdm`` for SGD-momentum).
"""
import sys

import torch

from experiments.screening import run_prefix
from experiments.suite import STEPS
from gradcomp import recipe


def main(fraction: float, workload: str, seed: int, log: str, optimizer: str = "adamw") -> None:
    torch.set_num_threads(1)
    recipe.DENSE_FRACTION = recipe.ADAM_DENSE_FRACTION = fraction
    run_prefix(STEPS[workload], log, workload, optimizer, "topk", seed)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
