"""The recipe's DelayedMomentumSGD with one change, on the study's top-k run under SGD-momentum (seed 0).

* ``density``: the delay given up grows with the density's fall, ``DELAY_STEPS * log(1/rho) / log(1/rho_final)``
  (``rho`` the density compressing the group this step, ``rho_final`` the recipe's, 1/100): error feedback
  holds a coordinate back about as long as it takes to rank among the top ``rho`` share.
* ``steplr``: the momentum shortened without the larger first step (``k = 1``: ``b <- beta' b + g``), so a
  steady gradient moves ``lr / (1 - beta')`` per step, less than dense's.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_stage_variant.py VARIANT STEPS LOG WORKLOAD``
"""
import math
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.optim import delayed_momentum
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD, compressed_momentum


def main(variant: str, stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    after_compress, step = DelayedMomentumSGD.after_compress, DelayedMomentumSGD._step
    density = {}

    def recording(self, keys, payload, compressor, numel):
        after_compress(self, keys, payload, compressor, numel)
        density[id(self)] = getattr(compressor, "density", 0.01)

    def stepped(self, param, group, fast, k):
        beta = float(group["momentum"])
        if variant == "density":
            rho = density.get(id(self), 0.01)
            delay = delayed_momentum.DELAY_STEPS * min(1.0, math.log(1 / rho) / math.log(100))
            fast = compressed_momentum(beta, delay)
            k = (1 - fast) / (1 - beta)
        elif variant == "steplr":
            k = 1.0
        return step(self, param, group, fast, k)

    DelayedMomentumSGD.after_compress, DelayedMomentumSGD._step = recording, stepped
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
