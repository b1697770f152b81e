"""The spike guard's screen: r = rms(.grad / d) over the optimizer's parameters (d: frozen denominator, else
sqrt(v_hat) + eps), EMA mean and variance (ALPHA); in the frozen phase, after 10 observed steps, where
r > mu + Z * sigma every .grad is scaled by (mu + Z * sigma) / r before the step. The first 3 steps are not
observed. Statistics in float64 on the host (gradcomp.optim.spike_guard keeps them in float32 on the device).
Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-spike-guard/screen_zclip.py LOG WORKLOAD METHOD Z
    [SEED] [OPT] [ALPHA]"""
import json
import math
import sys

import torch

from experiments import screening, simrun  # noqa: F401
from experiments.convergence import RunSpec

Z = float(sys.argv[4])
ALPHA = float(sys.argv[7]) if len(sys.argv) > 7 else 0.97
STATS = {}
OUT = open(sys.argv[1] + ".z", "w", buffering=1)

def pre_hook(opt, args, kwargs):
    num = den = 0.0
    frozen = False
    grads = []
    for group in opt.param_groups:
        b2 = group["betas"][1]
        for p in group["params"]:
            st = opt.state.get(p, {})
            if p.grad is None or "exp_avg_sq" not in st or float(st["step"]) == 0:
                continue
            if "frozen_denom" in st:
                d = st["frozen_denom"]
                frozen = True
            else:
                d = (st["exp_avg_sq"] / (1 - b2 ** float(st["step"]))).sqrt() + group["eps"]
            num += float((p.grad.float() / d).pow(2).sum())
            den += p.numel()
            grads.append(p.grad)
    if not den:
        return
    r = math.sqrt(num / den)
    count = STATS.setdefault(("n", id(opt)), [0])
    count[0] += 1
    if count[0] <= 3:  # Adam's first steps: v from one or two gradients
        return
    mu, var, n = STATS.get(id(opt), (r, 0.0, 0))
    limit = mu + Z * math.sqrt(var)
    scale = 1.0
    if frozen and n >= 10 and r > limit:
        scale = limit / r
        torch._foreach_mul_(grads, scale)
        r = limit
    var = ALPHA * var + (1 - ALPHA) * (r - mu) ** 2
    mu = ALPHA * mu + (1 - ALPHA) * r
    STATS[id(opt)] = (mu, var, n + 1)
    OUT.write(json.dumps({"opt": id(opt) % 1000, "r": r, "scale": scale, "mu": mu, "sd": math.sqrt(var)}) + "\n")

if __name__ == "__main__":
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from experiments import convergence as cv
    from experiments import suite
    register_optimizer_step_pre_hook(pre_hook)
    torch.set_num_threads(1)
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    opt = sys.argv[6] if len(sys.argv) > 6 else "adamw"
    steps = suite.STEPS[sys.argv[2]]
    simrun.run(RunSpec(sys.argv[2], opt, sys.argv[3], seed, steps, max(1, steps // cv.EVALS)), sys.argv[1])
