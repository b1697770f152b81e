"""The unclipped GPT loop (``gpt-noclip``, AdamW, 1000 steps, seed 0) with its peak learning rate scaled: is the
clip's gain on 2-bit what a uniformly lower learning rate would give?

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/gpt-clip/lr-scaled/screen_lr.py LOG
SCALE METHOD`` (``METHOD``: ``dense`` or ``twobit``, the recipe); the in-process simulation of 2 ranks.
"""
import sys
from dataclasses import replace

import torch

from experiments import loop as loops
from experiments import (
    screening,  # noqa: F401  (one thread for every pool, before numba loads)
    simrun,
)
from experiments.convergence import RunSpec

SCALE = float(sys.argv[2])
_loop_for = loops.loop_for


def loop_for(workload, optimizer, steps, **overrides):
    loop = _loop_for(workload, optimizer, steps, **overrides)
    return replace(loop, lr=loop.lr * SCALE)


if __name__ == "__main__":
    loops.loop_for = loop_for
    torch.set_num_threads(1)
    simrun.run(RunSpec("gpt-noclip", "adamw", sys.argv[3], 0, 1000, 20), sys.argv[1])
