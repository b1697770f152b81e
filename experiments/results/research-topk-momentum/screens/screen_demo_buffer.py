"""Top-k under SGD-momentum in DeMo's arrangement: the momentum is the error buffer, nothing runs after the exchange.

Each rank's residual decays by the momentum every step (``Engine(residual_decay=beta)``: ``e <- beta (acc - sent)``,
so ``acc = g + e`` is DeMo's ``m <- beta m + g`` less what was sent), and on compressed steps the update is the
average of what was sent at SGD's steady-state step size, ``p -= lr / (1 - beta) * (.grad + wd p)``, with no
momentum after the exchange (SGD's buffer is set to ``.grad / (1 - beta)`` so that a dense step continues it).
A coordinate sent every step moves as under dense SGD-momentum; one held back loses what the decay forgets.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_demo_buffer.py STEPS LOG WORKLOAD``
"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp import recipe
from gradcomp.compressors import TopK
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD


def main(stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    decay_of = recipe._residual_decay
    recipe._residual_decay = lambda optimizer, compressor: (
        0.9 if isinstance(compressor, TopK) and isinstance(optimizer, torch.optim.SGD) else decay_of(optimizer, compressor))

    @torch.no_grad()
    def before_optimizer_step(self):
        compressed = {id(self.names[k]) for k in self._compressed if k in self.names}
        self._compressed.clear()
        self._cleared = []
        for group in self.optimizer.param_groups:
            beta = float(group["momentum"])
            for param in group["params"]:
                if param.grad is None or id(param) not in compressed:
                    continue
                d = param.grad.clone()
                if group["weight_decay"]:
                    d.add_(param, alpha=group["weight_decay"])
                buf = self.optimizer.state[param]["momentum_buffer"] = d.div_(1 - beta)
                param.add_(buf, alpha=-float(group["lr"]))
                self._cleared.append((param, param.grad))
                param.grad = None

    DelayedMomentumSGD.before_optimizer_step = before_optimizer_step
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
