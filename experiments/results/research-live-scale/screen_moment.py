"""As ``screen_group.py``, for top-k's momentum exchange, with the level measured on the quantity ``.grad`` holds there:
the group's ``n = b2 * n + (1 - b2) * mean(m_hat^2)`` over the averaged first moment ``m_hat = .grad / (1 - b1^t)``,
from ``n_0 = mean(m_hat^2)`` of Adam's own ``exp_avg`` at the freeze; each frozen step times ``sqrt(n_0 / n)``. The
moment's mean square is below the gradients' (it averages the noise), so measuring both ends on the moment removes
the offset ``screen_group.py``'s level has under this exchange (README, "Top-k's momentum exchange").

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-live-scale/screen_moment.py LOG WORKLOAD METHOD [SEED] [OPT]
"""
import sys

from experiments import screening  # one thread for every pool, before numba loads
from gradcomp.optim import frozen_adam

LEVEL = {}  # id(param group) -> [n_0, n]
_update = frozen_adam.frozen_update


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    beta1, beta2 = group["betas"]
    elements = sum(g.numel() for g in grads)
    level = LEVEL.get(id(group))
    if level is None:  # exp_avgs are Adam's own at the freeze, steps[0] - 1 steps in
        n0 = sum(float(m.float().square().sum()) for m in exp_avgs) / elements / (1 - beta1 ** (steps[0] - 1)) ** 2
        level = LEVEL[id(group)] = [n0, n0]
    mean_square = sum(float(g.float().square().sum()) for g in grads) / elements / (1 - beta1 ** steps[0]) ** 2
    level[1] = beta2 * level[1] + (1 - beta2) * mean_square
    factor = (level[0] / max(level[1], 1e-30)) ** 0.5
    return _update(params, exp_avgs, [g * factor for g in grads], denoms, steps, group, decoupled, exchange, bounded)


if __name__ == "__main__":
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0,
                        sys.argv[5] if len(sys.argv) > 5 else "adamw")
