"""A residual that cannot outgrow the gradient it compensates: the study's run (seed 0, its loop and
length; SGD-momentum unless named) through the recipe, with every group's committed residual ``e``
scaled, before each compressed step, to at most the norm of that step's gradient ``g`` of the group
(``e *= min(1, |g| / |e|)``), in the study's simulation of 2 ranks, patched from outside.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-threebit-adamw/screens/screen_residual.py STEPS LOG
[WORKLOAD [OPTIMIZER]]`` (STEPS: where to stop, of the study's run).
"""
import sys

import torch

from experiments import simrun
from experiments.convergence import RunSpec
from experiments.suite import STEPS
from gradcomp.engine import Engine


def clipped(compensate):
    def run(self, handle, source):
        buffers = compensate(self, handle, source)
        if buffers is not None:
            residual, grad_norm = buffers[0], source.norm()
            norm = residual.norm()
            if norm > grad_norm:
                residual.mul_(grad_norm / norm)
        return buffers
    return run


def main(stop: int, log: str, workload: str = "charlm-small", optimizer: str = "sgdm") -> None:
    torch.set_num_threads(1)
    Engine._compensate = clipped(Engine._compensate)
    train_step = simrun._train_step

    def limited(sim, workload_, loop, step, schedulers):
        if step >= stop:
            raise KeyboardInterrupt  # the first STOP steps of the study's schedule
        return train_step(sim, workload_, loop, step, schedulers)

    simrun._train_step = limited
    try:
        simrun.run(RunSpec(workload, optimizer, "twobit", 0, STEPS[workload], STEPS[workload] // 50), log)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
