"""Top-k under SGD-momentum with each rank's own first moment exchanged (the Adam stage's arrangement).

Under the frozen-variance Adam a sparsifier exchanges each rank's first moment ``m_i = b1' m_i + (1 - b1') g_i``
(an exponential average, gradient units) with error feedback, ``b1'`` shortened by the delay error feedback
adds; the top-k gap of the main job's cell fell from +3.1 % to under 1 % with the shortening. Under SGD the
recipe exchanges the gradient and runs the (shortened) momentum after the exchange. This screen gives SGD the
Adam arrangement: on a compressed step each rank compresses ``m_i = beta' m_i + (1 - beta') (g_i + wd p)``
(``beta'`` the stage's, :func:`~gradcomp.optim.delayed_momentum.compressed_momentum` at ``delay_at(rho)``;
the first compressed step starts from SGD's buffer times ``1 - beta``), the average ``m`` lands in ``.grad``,
and the step sets SGD's buffer to ``m / (1 - beta)`` and moves ``p -= lr * buffer`` (a steady gradient moves
``lr / (1 - beta)`` per step, as dense SGD's). No Nesterov (the study's loop has none).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_momentum_exchange.py STEPS LOG
WORKLOAD``
"""
import sys

import torch

import gradcomp.optim as optim
from experiments.screening import run_prefix
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD, compressed_momentum, delay_at


class MomentumExchangeSGD(DelayedMomentumSGD):
    """DelayedMomentumSGD whose compressed steps exchange each rank's first moment (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.moments, self._pending = {}, {}
        self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}

    def before_compress(self, keys, numels, grad, compressor):
        out, offset, pending = grad.float().clone(), 0, []
        density = compressor.density if compressor.sparsifies else 1.0
        for key, n in zip(keys, numels):
            param, piece = self.names[key], out[offset: offset + n]
            offset += n
            group = self._groups[id(param)]
            beta = float(group["momentum"])
            fast = compressed_momentum(beta, delay_at(density, self.delay_steps))
            if group["weight_decay"]:
                piece.add_(param.detach().reshape(-1).float(), alpha=group["weight_decay"])
            moment = self.moments.get(key)
            if moment is None:
                buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
                moment = buf.reshape(-1).float() * (1 - beta) if buf is not None else piece.clone()
            piece.copy_(torch.lerp(moment, piece, 1 - fast))
            pending.append((key, piece.clone()))
        self._pending[tuple(keys)] = pending
        return out

    def commit(self, keys, accept=True):
        for key, moment in self._pending.pop(tuple(keys), ()):
            if bool(accept):
                self.moments[key] = moment

    def dense(self, keys, numels, grad):
        for key in keys:
            self.moments.pop(key, None)
        return super().dense(keys, numels, grad)

    @torch.no_grad()
    def before_optimizer_step(self):
        compressed = {id(self.names[key]) for key in self._compressed if key in self.names}
        self._compressed.clear()
        self._cleared = []
        for group in self.optimizer.param_groups:
            beta = float(group["momentum"])
            for param in group["params"]:
                if param.grad is None or id(param) not in compressed:
                    continue
                buf = param.grad.div(1 - beta)
                self.optimizer.state[param]["momentum_buffer"] = buf
                param.add_(buf, alpha=-float(group["lr"]))
                self._cleared.append((param, param.grad))
                param.grad = None


def main(stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    optim.DelayedMomentumSGD = MomentumExchangeSGD
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
