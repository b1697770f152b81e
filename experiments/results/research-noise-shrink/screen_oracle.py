"""Frozen-variance Adam whose frozen steps shrink by what compression added to the averaged gradient's norm, known
exactly (an oracle only the simulation has): at each step ``f = min(1, |g| / |g_hat|)``, ``g`` the average of the
ranks' gradients before compression, ``g_hat`` the average the exchange wrote into ``.grad`` (error feedback's
carried residuals and the 2-bit codes' error included), both over every parameter before the loop's clip; every
frozen step's gradient is multiplied by ``f``. The clip divides 2-bit's average by its norm on most steps after the
freeze (it passes 1 more often than dense's): the screen asks whether shrinking by the compression's own excess
gives the unclipped run what the clip gives it. If it does, an estimate each rank can share (its own residual's
norms, a few bytes in the payload) is the next thing to build.

Usage, from the repository root:
PYTHONPATH=. python experiments/results/research-noise-shrink/screen_oracle.py LOG WORKLOAD METHOD [SEED] [OPT]
"""
import sys

from experiments import (
    screening,  # one thread for every pool, before numba loads
    simulate,
)
from gradcomp.optim import frozen_adam

TRUE = {}  # bucket index -> sum of the ranks' flat gradients this step
FACTOR = [1.0]
FACTORS = []
_start, _exchange, _update = simulate.Simulation._start, simulate.Simulation.exchange, frozen_adam.frozen_update


def start(self, rank, index, bucket, flat):
    TRUE[index] = flat.detach().float().clone() if index not in TRUE else TRUE[index] + flat.detach().float()
    return _start(self, rank, index, bucket, flat)


def exchange(self):
    TRUE.clear()
    _exchange(self)
    true = sum(float((total / self.world_size).square().sum()) for total in TRUE.values())
    sent = sum(float(p.grad.float().square().sum()) for _, p in self._named[0] if p.grad is not None)
    FACTOR[0] = min(1.0, (true / sent) ** 0.5) if sent > 0 else 1.0


def frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, exchange, bounded):
    FACTORS.append(FACTOR[0])
    return _update(params, exp_avgs, [g * FACTOR[0] for g in grads], denoms, steps, group, decoupled, exchange,
                   bounded)


if __name__ == "__main__":
    simulate.Simulation._start, simulate.Simulation.exchange = start, exchange
    frozen_adam.frozen_update = frozen_update
    screening.run_whole(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0,
                        sys.argv[5] if len(sys.argv) > 5 else "adamw")
    FACTORS.sort()
    if FACTORS:
        print(f"frozen steps {len(FACTORS)}; factor median {FACTORS[len(FACTORS) // 2]:.3f}, "
              f"10th percentile {FACTORS[len(FACTORS) // 10]:.3f}, min {FACTORS[0]:.3f}")
