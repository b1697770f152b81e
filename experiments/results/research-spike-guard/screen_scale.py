"""Frozen-variance Adam (exchange "gradient") whose frozen denominators keep a live per-tensor scale:
lam = b2 * lam + (1 - b2) * mean(g^2 / d^2), lam_0 = 1; the step divides by d * sqrt(lam) ("live") or
d * sqrt(max(1, lam)) ("grow").
Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-spike-guard/screen_scale.py LOG WORKLOAD METHOD MODE [SEED] [OPT]"""
import sys

import torch

from experiments import screening, simrun  # noqa: F401
from experiments.convergence import RunSpec
from gradcomp.optim import frozen_adam
from gradcomp.optim import frozen_update as fu

MODE = sys.argv[4]
LAM = {}
_update = fu.frozen_update

def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    if exchange != "gradient":
        return _update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded)
    b2 = group["betas"][1]
    scaled = []
    for g, d in zip(grads, denoms):
        lam = LAM.get(id(d), 1.0)
        lam = b2 * lam + (1 - b2) * float((g.float() / d).pow(2).mean())
        LAM[id(d)] = lam
        s = max(1.0, lam) if MODE == "grow" else lam
        scaled.append(d * s ** 0.5)
    return _update(params, exp_avgs, grads, scaled, steps, group, decoupled, exchange, bounded)

if __name__ == "__main__":
    frozen_adam.frozen_update = frozen_update
    torch.set_num_threads(1)
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    opt = sys.argv[6] if len(sys.argv) > 6 else "adamw"
    from experiments import convergence as cv
    from experiments import suite
    steps = suite.STEPS[sys.argv[2]]
    simrun.run(RunSpec(sys.argv[2], opt, sys.argv[3], seed, steps, max(1, steps // cv.EVALS)), sys.argv[1])
