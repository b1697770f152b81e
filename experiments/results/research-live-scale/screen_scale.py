"""Frozen-variance Adam whose frozen denominators keep a live scale per parameter: the shape of ``sqrt(v_hat)`` is
frozen, its level follows the gradients. Each parameter keeps ``n = b2 * n + (1 - b2) * mean(g^2)`` (``g``: what
the frozen update steps on, ``.grad`` as the loop left it, clipped or not), starting at the freeze from
``mean((d - eps)^2)`` of its frozen denominator ``d``; each frozen step's gradient is multiplied by
``sqrt(n_0 / n) ** POWER`` (``POWER`` 1: Adam's own response to a change of the gradient's scale, on one number a
parameter; 0: the recipe). Where the clip binds after the freeze it divides the gradient by its norm, which a
frozen variance passes into the step and a live one would absorb: the screen asks whether a live scale gives
the unclipped run what the clip gives it.

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-live-scale/screen_scale.py LOG WORKLOAD METHOD POWER [SEED] [OPT]
"""
import sys

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

POWER = float(sys.argv[4])
LEVEL = {}  # id(param) -> [n_0, n]
_update = frozen_adam.frozen_update


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    beta2, eps = group["betas"][1], group["eps"]
    scaled = []
    for param, grad, denom in zip(params, grads, denoms):
        level = LEVEL.get(id(param))
        if level is None:
            n0 = float((denom - eps).square().mean())
            level = LEVEL[id(param)] = [n0, n0]
        level[1] = beta2 * level[1] + (1 - beta2) * float(grad.float().square().mean())
        scaled.append(grad * (level[0] / max(level[1], 1e-30)) ** (POWER / 2))
    return _update(params, exp_avgs, scaled, denoms, steps, group, decoupled, exchange, bounded)


if __name__ == "__main__":
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[5]) if len(sys.argv) > 5 else 0,
                        sys.argv[6] if len(sys.argv) > 6 else "adamw")
