"""Short AdamW runs where 3-bit's dense start is a handful of steps: which code the recipe should give 2-bit.

Under Adam the dense start is also the window the variance is estimated in before it freezes. 3-bit's
payload costs more than the ternary code's, so in the same 8x byte budget its dense start is shorter (at
200 steps 2-3 steps against 8-9). :func:`gradcomp.recipe.code` keeps 3-bit only where its dense start
reaches :data:`gradcomp.optim.adam_settings.MIN_STEADY_FREEZE` (10) steps or the ternary code's, a
threshold set on charlm-small alone (200 steps: 2 dense steps ended +18.2 % above dense, 8 -0.3 %). This
screen runs the study's AdamW loop of ``WORKLOAD`` for ``STEPS`` steps (the in-process simulation of 2
ranks, the study's evaluations every 2 % of the run) as ``CODE``: ``dense``, ``threebit`` (the threshold
set to 0: 3-bit whatever its dense start) or ``ternary`` (set beyond any run: the ternary code).

``MIN_DENSE`` (optional) holds the dense start to at least that many steps, the byte budget notwithstanding:
does a freeze after the loop's learning-rate warm-up (20 steps in the GPT loop, set by hand) train the runs
that froze inside it?

``TAIL`` (optional, ``last`` unless named): where a late freeze's ternary steps go (``gradcomp.recipe._replan``):
``last``, the recipe's, the run's last steps; ``first``, right after the freeze, then 3-bit to the end.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-steady-freeze/screens/screen_freeze.py CODE LOG WORKLOAD
STEPS [SEED [MIN_DENSE [TAIL]]]`` (seed 0 unless named).
"""
import sys

import torch

from experiments import (
    screening,  # noqa: F401  (one thread for every pool, before numba loads)
    simrun,
)
from experiments.convergence import RunSpec
from gradcomp import recipe, schedule
from gradcomp.optim import adam_settings

THRESHOLDS = {"threebit": 0, "ternary": 10**9}


class TernaryFirst(schedule.CodeSwitch):
    """The same steps of ``later`` as :class:`~gradcomp.schedule.CodeSwitch`, right after the dense start."""

    def compressor_at(self, step, base):
        if step < self.dense_steps:
            return None
        return self.later if step < self.dense_steps + (self.total - self.switch_step) else base


def main(code: str, log: str, workload: str, steps: str, seed: str = "0", min_dense: str = "0",
         tail: str = "last") -> None:
    torch.set_num_threads(1)
    if tail == "first":
        TernaryFirst.total = int(steps)
        recipe.CodeSwitch = TernaryFirst
    if code != "dense":
        adam_settings.MIN_STEADY_FREEZE = THRESHOLDS[code]
    dense_start = recipe._dense_start
    recipe._dense_start = lambda *args, **kwargs: max(int(min_dense), dense_start(*args, **kwargs))
    method = "dense" if code == "dense" else "twobit"
    simrun.run(RunSpec(workload, "adamw", method, int(seed), int(steps), max(1, int(steps) // 50)), log)


if __name__ == "__main__":
    main(*sys.argv[1:])
