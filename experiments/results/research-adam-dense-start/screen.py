"""Top-k's dense start under Adam, shortened: is it dense's quality sooner on a slow link?

The recipe keeps Adam's dense start (its second moment estimated densely, then frozen) for at least
:data:`gradcomp.recipe.ADAM_DENSE_FRACTION` (10 %) of the run, and spends the rest of the 8x byte budget on
top-k's ramp. On the study's digits MLP at 100 Mbit/s the dense start and ramp are most of top-k's time to
dense's quality (0.44x against the 0.35x asked): by its step 439, where it reaches the target, it had sent a
quarter of dense's bytes. This screen runs the study's loop of ``WORKLOAD`` under ``OPTIMIZER`` with the
top-k recipe and that fraction (``DENSE_FRACTION`` under SGD) set to ``FRACTION`` (the in-process simulation
of 2 ranks, the study's evaluations every 2 % of the run), and writes the study's log.

``RAMP_AT`` (optional) holds the schedule's dense start (the bytes) to at least that many steps while the
variance still freezes at the fraction's start: which of the two does a short start break? ``FLOOR`` (optional)
replaces :data:`gradcomp.optim.adam_settings.VARIANCE_FLOOR` (the frozen denominator's floor, a share of its
parameter's mean): does a higher floor make an early freeze safe?

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-adam-dense-start/screen.py
LOG WORKLOAD OPTIMIZER STEPS SEED FRACTION [RAMP_AT [FLOOR]]``; ``analyse.py`` reads the logs.
"""
import functools
import sys

import torch

from experiments import (
    screening,  # noqa: F401  (one thread for every pool, before numba loads)
    simrun,
)
from experiments.convergence import RunSpec
from gradcomp import optim, recipe
from gradcomp.optim import frozen_adam


def main(log: str, workload: str, optimizer: str, steps: str, seed: str, fraction: str, ramp_at: str = "0",
         floor: str = "") -> None:
    torch.set_num_threads(1)
    if floor:  # the stage the recipe builds, with that floor
        optim.FrozenVarianceAdam = functools.partial(frozen_adam.FrozenVarianceAdam, variance_floor=float(floor))
    recipe.ADAM_DENSE_FRACTION = recipe.DENSE_FRACTION = float(fraction)
    schedule = recipe._schedule
    recipe._schedule = lambda compressor, total, dense_steps, budget, traffic: schedule(
        compressor, total, max(int(ramp_at), dense_steps), budget, traffic)
    simrun.run(RunSpec(workload, optimizer, "topk", int(seed), int(steps), max(1, int(steps) // 50)), log)


if __name__ == "__main__":
    main(*sys.argv[1:])
