"""The recipe's DelayedMomentumSGD with one change, on the study's top-k run under SGD-momentum (seed 0).

* ``density``: the delay given up grows with the density's fall, ``DELAY_STEPS * log(1/rho) / log(1/rho_final)``
  (``rho`` the density compressing the group this step, ``rho_final`` the recipe's, 1/100): error feedback
  holds a coordinate back about as long as it takes to rank among the top ``rho`` share.
* ``steplr``: the momentum shortened without the larger first step (``k = 1``: ``b <- beta' b + g``), so a
  steady gradient moves ``lr / (1 - beta')`` per step, less than dense's.
* ``measured``: the delay given up is measured, not assumed: Little's law, the residual's mass over the mass
  of gradient arriving per step (``sum |e'| / sum |g|`` over every group and simulated rank each step, an
  exponential average over 10 steps), at most ``beta / (1 - beta)``. One scalar per step, which real ranks
  would agree on with an allreduce of two numbers.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_stage_variant.py VARIANT STEPS LOG
WORKLOAD``
"""
import math
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.compressors import TopK
from gradcomp.optim import delayed_momentum
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD, compressed_momentum


def main(variant: str, stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    after_compress, step = DelayedMomentumSGD.after_compress, DelayedMomentumSGD._step
    density, mass, delay_now, seen = {}, [0.0, 0.0], [0.0], [0]
    compress = TopK.compress

    def measuring(self, tensor, residual=None, residual_out=None, backend=None):
        payload = compress(self, tensor, residual, residual_out, backend)
        if residual_out is not None:
            mass[0] += float(residual_out.abs().sum())
            mass[1] += float(tensor.float().abs().sum())
        return payload

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
        elif variant == "measured":
            fast = compressed_momentum(beta, min(delay_now[0], beta / (1 - beta)))
            k = (1 - fast) / (1 - beta)
        return step(self, param, group, fast, k)

    before_step = DelayedMomentumSGD.before_optimizer_step

    def averaged(self):
        if mass[1] > 0:  # once per step, at the first rank's stage: every rank then uses the same delay
            delay_now[0] += 0.1 * (mass[0] / mass[1] - delay_now[0])
            mass[0] = mass[1] = 0.0
            seen[0] += 1
            if seen[0] % 50 == 0:
                print(f"screen_stage_variant: compressed step {seen[0]}, delay {delay_now[0]:.2f} steps",
                      file=sys.stderr, flush=True)
        before_step(self)

    DelayedMomentumSGD.after_compress, DelayedMomentumSGD._step = recording, stepped
    if variant == "measured":
        TopK.compress, DelayedMomentumSGD.before_optimizer_step = measuring, averaged
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
