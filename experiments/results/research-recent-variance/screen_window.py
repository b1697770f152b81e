"""Frozen-variance Adam whose denominators freeze from the dense start's *recent* gradients: during the dense
start each parameter keeps r = b * r + (1 - b) * g^2 beside Adam's own exp_avg_sq (g: ``.grad`` as the loop left
it, clipped or not), and the freeze takes d = sqrt(r / (1 - b^t)) instead of sqrt(v_hat) (the same floor and eps).
b = BETA (0.999 is Adam's own: the recipe up to rounding).
With MODE ``norm``: r = 0.999 * r + 0.001 * g^2 / |g|^2 (each step's gradient at unit norm, |g| over every
parameter, as the clip measures it: the variance's shape from the whole dense start) and n = b * n + (1 - b) * |g|^2
(its scale from the recent steps); the freeze takes d = sqrt(r_hat * n_hat).

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-recent-variance/screen_window.py LOG WORKLOAD METHOD MODE BETA [SEED] [OPT]
"""
import sys

import torch

from experiments import screening, simrun  # noqa: F401  (one thread for every pool, before numba loads)
from experiments.convergence import RunSpec
from gradcomp.optim.frozen_adam import FrozenVarianceAdam

MODE, BETA = sys.argv[4], float(sys.argv[5])
RECENT = {}  # param -> (r, steps)
NORM = [0.0, 0]  # n, steps
_before, _denom = FrozenVarianceAdam.before_optimizer_step, FrozenVarianceAdam._denom


def before_optimizer_step(self):
    _before(self)
    params = [p for group in self.optimizer.param_groups for p in group["params"]
              if p.grad is not None and not self.frozen(p)]
    if not params:
        return
    sq = float(sum(p.grad.float().pow(2).sum() for p in params))
    if MODE == "norm":
        NORM[0], NORM[1] = BETA * NORM[0] + (1 - BETA) * sq, NORM[1] + 1
    beta, scale = (0.999, 1 / sq) if MODE == "norm" else (BETA, 1.0)
    for param in params:
        r, t = RECENT.get(param, (torch.zeros_like(param, dtype=torch.float32), 0))
        r.mul_(beta).addcmul_(param.grad, param.grad, value=(1 - beta) * scale)
        RECENT[param] = (r, t + 1)


def denom(self, param, group):
    state = self.optimizer.state[param]
    if "frozen_denom" not in state and param in RECENT:
        r, t = RECENT.pop(param)
        if MODE == "norm":
            sqrt_v = (r / (1 - 0.999 ** t) * (NORM[0] / (1 - BETA ** NORM[1]))).sqrt_()
        else:
            sqrt_v = (r / (1 - BETA ** t)).sqrt_()
        floor = float(sqrt_v.mean()) * self.variance_floor
        state["frozen_denom"] = sqrt_v.clamp(min=floor).add_(group["eps"])
    return _denom(self, param, group)


if __name__ == "__main__":
    FrozenVarianceAdam.before_optimizer_step = before_optimizer_step
    FrozenVarianceAdam._denom = denom
    torch.set_num_threads(1)
    seed = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    opt = sys.argv[7] if len(sys.argv) > 7 else "adamw"
    from experiments import convergence as cv
    from experiments import suite
    steps = suite.STEPS[sys.argv[2]]
    simrun.run(RunSpec(sys.argv[2], opt, sys.argv[3], seed, steps, max(1, steps // cv.EVALS)), sys.argv[1])
