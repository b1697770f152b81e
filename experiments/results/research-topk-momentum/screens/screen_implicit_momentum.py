"""Top-k under SGD-momentum with less explicit momentum while compressing, the same step size.

Why: delayed gradients act as momentum of their own ("Asynchrony begets momentum", Mitliagkas et al.,
2016): a coordinate that error feedback holds back ``n`` steps arrives late, and a gradient that arrives
late adds to the explicit momentum's own lag. If the top-k gap under SGD-momentum is that surplus, a
smaller explicit momentum while compressing closes it.

From the first compressed step on, each SGD group's momentum becomes ``BETA`` and its learning rate is
multiplied by ``(1 - BETA) / (1 - beta)`` (``beta`` the loop's, 0.9), so that a steady gradient moves a
parameter by the same ``lr / (1 - beta)`` per step as before; each momentum buffer is multiplied by
``(1 - beta) / (1 - BETA)`` once at the switch, so the next step is continuous. The study's top-k run
otherwise (seed 0, its loop and length, in-process simulation of 2 ranks).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_implicit_momentum.py BETA STEPS LOG [WORKLOAD [METHOD]]``
"""
import sys

import torch

from experiments import loop as loops
from experiments.screening import recorded_engines, run_prefix


def main(beta_new: float, stop: int, log: str, workload: str = "gpt", method: str = "topk") -> None:
    torch.set_num_threads(1)
    switched = set()
    engines = recorded_engines()
    before_step = loops.before_step

    def adjusted(loop, model, optimizer, scaler=None):
        norm = before_step(loop, model, optimizer, scaler)
        if engines[0].compressor_now() is None:
            return norm
        for group in optimizer.param_groups:
            beta = loop.momentum
            if id(optimizer) not in switched:
                for param in group["params"]:
                    buf = optimizer.state.get(param, {}).get("momentum_buffer")
                    if buf is not None:
                        buf.mul_((1 - beta) / (1 - beta_new))
            group["momentum"] = beta_new
            group["lr"] = group["lr"] * (1 - beta_new) / (1 - beta)
        switched.add(id(optimizer))
        return norm

    loops.before_step = adjusted
    run_prefix(stop, log, workload, "sgdm", method)


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
