"""The delay given up, shared out between parameters by how long each one's coordinates wait.

The recipe's ``DelayedMomentumSGD`` gives every parameter compressed at density ``rho`` the same delay,
``delay_at(rho)``. On the GPT the group-wide top-k starves the middle block: its residuals hold 2.4-3.5
gradients' worth against about one elsewhere (``../research-topk-cap/``), so its coordinates wait longer
and its implicit momentum is larger. Here each parameter ``p`` gives up ``delay_at(rho) * w_p / w``, with
``w_p = E|e_p|_1 / E|g_p|_1`` (Little's law per parameter: its residual's mass over the mass of gradient
arriving per step, exponential averages over 10 steps; rank 0's residual, the averaged ``.grad``) and
``w`` the same ratio over every parameter: the rule's delay on average, more where coordinates wait
longer, at most ``beta / (1 - beta)`` (momentum 0).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_parameter_delay.py STEPS LOG
WORKLOAD``
"""
import sys

import torch

from experiments.screening import recorded_engines, run_prefix
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD, compressed_momentum, delay_at


def main(stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    engines = recorded_engines()
    residual_mass, gradient_mass = {}, {}

    @torch.no_grad()
    def before_optimizer_step(self):
        compressed = {id(self.names[k]): d for k, d in self._compressed.items() if k in self.names}
        self._compressed.clear()
        self._cleared = []
        names = {id(p): k for k, p in self.names.items()}
        for key, param in self.names.items():
            residual = engines[0].residual_memory.residual(key)
            if param.grad is None or residual is None or id(param) not in compressed:
                continue
            for store, value in ((residual_mass, float(residual.abs().sum())),
                                 (gradient_mass, float(param.grad.abs().sum()))):
                store[key] = store.get(key, value) + 0.1 * (value - store.get(key, value))
        total = sum(residual_mass.values()) / max(sum(gradient_mass.values()), 1e-30)
        for group in self.optimizer.param_groups:
            beta = float(group["momentum"])
            for param in group["params"]:
                key = names.get(id(param))
                if param.grad is None or id(param) not in compressed or key not in residual_mass:
                    continue
                share = residual_mass[key] / max(gradient_mass[key], 1e-30) / max(total, 1e-30)
                delay = min(delay_at(compressed[id(param)], self.delay_steps) * share, beta / (1 - beta))
                if delay <= 0:
                    continue
                fast = compressed_momentum(beta, delay)
                self._step(param, group, fast, (1 - fast) / (1 - beta))
                self._cleared.append((param, param.grad))
                param.grad = None

    DelayedMomentumSGD.before_optimizer_step = before_optimizer_step
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
