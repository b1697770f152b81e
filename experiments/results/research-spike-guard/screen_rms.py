"""Log Adam's step in update units (rms of m_hat / denominator over all parameters) per optimizer step.
Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-spike-guard/screen_rms.py LOG WORKLOAD METHOD [SEED]"""
import json
import math
import sys

import torch

from experiments import screening, simrun  # noqa: F401
from experiments.convergence import RunSpec

OUT = open(sys.argv[1] + ".rms", "w", buffering=1)
count = [0]

def post_hook(opt, args, kwargs):
    num = den = 0.0
    frozen = 0
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            st = opt.state.get(p, {})
            if "exp_avg" not in st:
                continue
            t = float(st["step"])
            m = st["exp_avg"] / (1 - b1 ** t)
            if "frozen_denom" in st:
                d = st["frozen_denom"]
                frozen += 1
            else:
                d = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + group["eps"]
            num += float(((m / d) ** 2).sum())
            den += p.numel()
    row = {"opt": id(opt) % 1000, "n": count[0], "rms": math.sqrt(num / max(den, 1)), "frozen": frozen}
    OUT.write(json.dumps(row) + "\n")
    count[0] += 1

if __name__ == "__main__":
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(post_hook)
    torch.set_num_threads(1)
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    simrun.run(RunSpec(sys.argv[2], "adamw", sys.argv[3], seed, 1000, 20), sys.argv[1])
