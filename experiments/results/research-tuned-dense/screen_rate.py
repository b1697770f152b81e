"""One run of the convergence study with its peak learning rate scaled: is the study's dense baseline at its best
rate, and do the recipes keep their margin against dense at a better one?

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-tuned-dense/screen_rate.py LOG
WORKLOAD OPTIMIZER METHOD SCALE [SEED]`` (``METHOD``: ``dense``, ``topk`` or ``twobit``, the study's; the
in-process simulation of 2 ranks, the study's steps and evaluations). Only the peak rate changes: the warm-up,
the decay's shape and the weight decay (SGD's on the GPT included) are the study's.
"""
import sys
from dataclasses import replace

import torch

from experiments import convergence as cv
from experiments import loop as loops
from experiments import (
    screening,  # noqa: F401  (one thread for every pool, before numba loads)
    simrun,
    suite,
)
from experiments.convergence import RunSpec

SCALE = float(sys.argv[5])
_loop_for = loops.loop_for


def loop_for(workload, optimizer, steps, **overrides):
    loop = _loop_for(workload, optimizer, steps, **overrides)
    return replace(loop, lr=loop.lr * SCALE)


if __name__ == "__main__":
    loops.loop_for = loop_for
    torch.set_num_threads(1)
    workload, optimizer, method = sys.argv[2:5]
    seed = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    steps = suite.STEPS[workload]
    simrun.run(RunSpec(workload, optimizer, method, seed, steps, max(1, steps // cv.EVALS)), sys.argv[1])
