"""The recipe's frozen steps multiplied by a constant SCALE (every frozen update's gradient, so its first moment and
step, by SCALE: the frozen denominators divided by it), the dense start as it is. Does the unclipped GPT run end
where the clipped one does when its frozen steps are as large as the clip's frozen denominators make them?

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-clip-phase/screen_step_scale.py LOG WORKLOAD METHOD SCALE [SEED] [OPT]
"""
import sys

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

SCALE = float(sys.argv[4])
_update = frozen_adam.frozen_update


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    return _update(params, exp_avgs, [g * SCALE for g in grads], denoms, steps, group, decoupled, exchange, bounded)


if __name__ == "__main__":
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[5]) if len(sys.argv) > 5 else 0,
                        sys.argv[6] if len(sys.argv) > 6 else "adamw")
