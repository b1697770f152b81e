"""As ``screen_scale.py``, on one number per param group instead of one per parameter: the group's
``n = b2 * n + (1 - b2) * mean(g^2)`` over all its parameters' elements, from ``mean((d - eps)^2)`` at the freeze;
each frozen step of the group multiplied by ``sqrt(n_0 / n)`` (the shape of ``sqrt(v_hat)`` frozen per coordinate,
its level live per group, as Adam's would follow a change of the gradients' scale).

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-live-scale/screen_group.py LOG WORKLOAD METHOD [SEED] [OPT]
"""
import sys

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

LEVEL = {}  # id(param group) -> [n_0, n]
_update = frozen_adam.frozen_update


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    beta2, eps = group["betas"][1], group["eps"]
    elements = sum(g.numel() for g in grads)
    level = LEVEL.get(id(group))
    if level is None:
        n0 = sum(float((d - eps).square().sum()) for d in denoms) / elements
        level = LEVEL[id(group)] = [n0, n0]
    level[1] = beta2 * level[1] + (1 - beta2) * sum(float(g.float().square().sum()) for g in grads) / elements
    factor = (level[0] / max(level[1], 1e-30)) ** 0.5
    return _update(params, exp_avgs, [g * factor for g in grads], denoms, steps, group, decoupled, exchange, bounded)


if __name__ == "__main__":
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0,
                        sys.argv[5] if len(sys.argv) > 5 else "adamw")
