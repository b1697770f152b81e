"""The top-k ramp's shortest length on workloads other than charlm-small: the study's top-k run (its
loop, length and seed) with :data:`gradcomp.recipe.RAMP_MIN_FRACTION` set to ``FRACTION`` (the recipe's
0.4 was set on charlm-small alone). Under Adam the dense start gives way to the ramp's shortest length
within the byte budget, so a longer floor buys a longer ramp with a shorter variance window.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-ramp/screens/screen_ramp.py FRACTION LOG WORKLOAD
[OPTIMIZER [SEED]]`` (AdamW and seed 0 unless named); the run goes to its end.
"""
import sys

import torch

from experiments.screening import run_prefix
from experiments.suite import STEPS
from gradcomp import recipe


def main(fraction: str, log: str, workload: str, optimizer: str = "adamw", seed: str = "0") -> None:
    torch.set_num_threads(1)
    recipe.RAMP_MIN_FRACTION = float(fraction)
    run_prefix(STEPS[workload], log, workload, optimizer, "topk", int(seed))


if __name__ == "__main__":
    main(*sys.argv[1:])
