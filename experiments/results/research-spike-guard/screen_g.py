"""Log, before each optimizer step, ||.grad|| and rms(.grad / d) (d: frozen denominator, else sqrt(v_hat)+eps).
Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-spike-guard/screen_g.py LOG WORKLOAD METHOD [SEED]"""
import json
import math
import sys

import torch

from experiments import screening, simrun  # noqa: F401
from experiments.convergence import RunSpec

OUT = open(sys.argv[1] + ".g", "w", buffering=1)

def pre_hook(opt, args, kwargs):
    sq = num = den = 0.0
    per = {}
    for gi, group in enumerate(opt.param_groups):
        b2 = group["betas"][1]
        for pi, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            st = opt.state.get(p, {})
            g = p.grad.float()
            sq += float((g * g).sum())
            if "frozen_denom" in st:
                d = st["frozen_denom"]
            elif "exp_avg_sq" in st and float(st["step"]) > 0:
                d = (st["exp_avg_sq"] / (1 - b2 ** float(st["step"]))).sqrt() + group["eps"]
            else:
                continue
            s = float(((g / d) ** 2).sum())
            num += s
            den += p.numel()
            per[f"{gi}.{pi}"] = round(math.sqrt(s / p.numel()), 3)
    row = {"opt": id(opt) % 1000, "norm": math.sqrt(sq), "rms": math.sqrt(num / max(den, 1)), "per": per}
    OUT.write(json.dumps(row) + "\n")

if __name__ == "__main__":
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    register_optimizer_step_pre_hook(pre_hook)
    torch.set_num_threads(1)
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    simrun.run(RunSpec(sys.argv[2], "adamw", sys.argv[3], seed, 1000, 20), sys.argv[1])
