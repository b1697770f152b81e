"""What the research screens share (``experiments/results/research-*/screens/``): a study run cut short.

The screens change a piece of the recipe from outside (a constant, a patched function) and run the
study's own simulation of 2 ranks; :func:`run_prefix` runs the first steps of one of its runs.
"""
from __future__ import annotations

from experiments import simrun
from experiments.convergence import RunSpec
from experiments.suite import STEPS

__all__ = ["run_prefix"]


def run_prefix(stop: int, log: str, workload: str, optimizer: str, method: str, seed: int = 0) -> None:
    """The study's run of ``workload``/``optimizer``/``method`` (``seed``, its length), its first ``stop``
    steps, logged to ``log``."""
    train_step = simrun._train_step

    def limited(sim, workload_, loop, step, schedulers):
        if step >= stop:
            raise KeyboardInterrupt  # the first STOP steps of the study's schedule
        return train_step(sim, workload_, loop, step, schedulers)

    simrun._train_step = limited
    try:
        simrun.run(RunSpec(workload, optimizer, method, seed, STEPS[workload], STEPS[workload] // 50), log)
    except KeyboardInterrupt:
        pass
    finally:
        simrun._train_step = train_step
