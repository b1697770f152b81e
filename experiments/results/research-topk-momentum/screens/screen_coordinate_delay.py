"""Screen: SGD-momentum top-k with the delay given up per coordinate, from how long each coordinate waits.

The stage gives every compressed coordinate of a group one delay (the density's, raised below the peak rate by
``stable_delay``), yet a coordinate sent every step waits for nothing, and those carry most of the update. Here
each coordinate's delay is half its last wait between two sends (``(a - 1) / 2`` steps, the mean age of the mass
an ``a``-step lump holds), at most the group's delay (so no step answers a gradient harder than the stage does
now). The wait is read from the averaged gradient (non-zero where any rank sent), the same on every rank.
Usage: STEPS LOG WORKLOAD [SEED] [CAP(1/0)]"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.optim import delayed_momentum as dm

CAP = {"on": True}


def coordinate_step(self, params, group, fast, k):
    """The stage's ``_step`` with a momentum per coordinate (``fast``/``k`` give the group's delay bound)."""
    beta = float(group["momentum"])
    m = beta / (1 - beta)
    bound = m - fast / (1 - fast)  # the group's delay, from its beta'
    self._t = t = getattr(self, "_t", 0) + 1
    for param in params:
        grad = param.grad
        d = -grad if group.get("maximize") else grad
        if group["weight_decay"]:
            d = d.add(param, alpha=group["weight_decay"])
        state = self.optimizer.state[param]
        if "last_sent" not in state:
            state["last_sent"] = torch.full_like(grad, float(t))
            state["wait"] = torch.full_like(grad, 2 * bound + 1)  # unknown: the group's delay
        sent = grad != 0
        state["wait"] = torch.where(sent, t - state["last_sent"], state["wait"])
        state["last_sent"] = torch.where(sent, torch.full_like(grad, float(t)), state["last_sent"])
        delay = (state["wait"] - 1) / 2
        delay = delay.clamp(0, bound) if CAP["on"] else delay.clamp(0, m)
        left = m - delay
        fast_i = left / (1 + left)
        k_i = (1 - fast_i) / (1 - beta)
        buf = state.get("momentum_buffer")
        if buf is None:
            state["momentum_buffer"] = buf = d * k_i
        else:
            buf.mul_(fast_i).add_(d * k_i * (1 - group["dampening"]))
        param.add_(buf, alpha=-float(group["lr"]))


def main(stop, log, workload, seed=0, cap=1):
    torch.set_num_threads(1)
    CAP["on"] = bool(cap)
    dm.DelayedMomentumSGD._step = coordinate_step
    run_prefix(stop, log, workload, "sgdm", "topk", seed)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:6]))
