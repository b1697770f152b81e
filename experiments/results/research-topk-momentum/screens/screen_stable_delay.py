"""Screen: SGD-momentum top-k with the delay given up bounded by stability instead of fixed: as the learning
rate falls below its peak the stage may shorten the momentum further, as long as its first-step response
``k * lr_now`` (``k = (1 - beta') / (1 - beta)``) stays within the recipe's at the peak rate (``k0 * lr_peak``):
``D = 1 + m - (1 + m - D0) / r``, ``m = beta / (1 - beta)``, ``D0`` the recipe's delay at the density, ``r`` the
peak rate seen so far over the current one. Usage: STEPS LOG WORKLOAD [SEED]"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.optim import delayed_momentum as dm

RATIO = {"r": 1.0}
PEAK = {}


def main(stop, log, workload, seed=0):
    torch.set_num_threads(1)
    delay_at, before = dm.delay_at, dm.DelayedMomentumSGD.before_optimizer_step

    def bounded(density, delay_steps=dm.DELAY_STEPS):
        d0 = delay_at(density, delay_steps)
        m = 9.0  # momentum 0.9, the study's; compressed_momentum caps the delay at m
        return d0 if d0 <= 0 else 1 + m - (1 + m - d0) / RATIO["r"]

    def before_step(self):
        lr = float(self.optimizer.param_groups[0]["lr"])
        PEAK[id(self)] = peak = max(PEAK.get(id(self), 0.0), lr)
        RATIO["r"] = peak / lr if lr > 0 else 1.0
        return before(self)

    dm.delay_at = bounded
    dm.DelayedMomentumSGD.before_optimizer_step = before_step
    run_prefix(stop, log, workload, "sgdm", "topk", seed)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
