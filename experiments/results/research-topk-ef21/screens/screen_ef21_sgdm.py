"""Top-k as EF21-SGDM (Fatkhullin et al. 2023) under SGD-momentum: each rank tracks its own momentum and sends
a compressed difference to what its peers know of it; the loop's momentum is not run again on top.

On a compressed step each rank ``i`` updates its momentum ``v_i = beta v_i + (1 - beta) (g_i + wd p)``
(gradient units; ``beta`` the user's, or ``BETA`` when given), sends ``C(v_i - s_i)`` (the study's top-k
payload, the same bytes) and sets ``s_i += C(v_i - s_i)``; every rank keeps ``S``, the average of the
``s_i``, from the averaged payloads (``S += average``: bitwise the same on every rank). ``.grad`` receives
``S``, and the step sets SGD's buffer to ``S / (1 - beta_user)`` and moves ``p -= lr * buffer`` (a steady
gradient moves ``lr / (1 - beta_user)`` per step, as dense SGD-momentum's). No residual: what is not sent
stays in ``v_i - s_i``. The first compressed step starts ``v_i = s_i = S`` at SGD's buffer times
``1 - beta_user`` (the momentum every rank shares after the dense start); a dense step drops the state.

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-topk-ef21/screens/
screen_ef21_sgdm.py STEPS LOG WORKLOAD [SEED [BETA]]``
"""
import sys

import torch

import gradcomp.optim as optim
from experiments import simrun
from experiments.screening import run_prefix
from gradcomp.optim.delayed_momentum import DelayedMomentumSGD

TRACK_BETA = {"beta": None}


class EF21SGDM(DelayedMomentumSGD):
    """The stage with EF21-SGDM's state per group (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.v, self.s, self.shared = {}, {}, {}
        self._groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}

    def _pieces(self, keys, numels, flat):
        offset = 0
        for key, n in zip(keys, numels):
            yield key, self.names[key], self._groups[id(self.names[key])], flat[offset: offset + n]
            offset += n

    def before_compress(self, keys, numels, grad, compressor):
        group_key, d = tuple(keys), grad.float().clone()
        if group_key not in self.v:  # the first compressed step: every rank starts at the shared momentum
            start = torch.zeros_like(d)
            for _, param, group, piece in self._pieces(keys, numels, start):
                buf = self.optimizer.state.get(param, {}).get("momentum_buffer")
                if buf is not None:
                    piece.copy_(buf.reshape(-1).float() * (1 - float(group["momentum"])))
            self.v[group_key], self.s[group_key], self.shared[group_key] = start, start.clone(), start.clone()
        v = self.v[group_key]
        pieces = zip(self._pieces(keys, numels, d), self._pieces(keys, numels, v))
        for (_, param, group, d_piece), (_, _, _, v_piece) in pieces:
            if group["weight_decay"]:
                d_piece.add_(param.detach().reshape(-1).float(), alpha=group["weight_decay"])
            beta = float(group["momentum"]) if TRACK_BETA["beta"] is None else TRACK_BETA["beta"]
            v_piece.mul_(beta).add_(d_piece, alpha=1 - beta)
        return v - self.s[group_key]

    def after_compress(self, keys, payload, compressor, numel):
        super().after_compress(keys, payload, compressor, numel)
        self.s[tuple(keys)].add_(compressor.decompress(payload, torch.zeros(numel)))

    def after_average(self, keys, numels, average, dense):
        if dense:
            return
        shared = self.shared[tuple(keys)]
        shared.add_(average.float())
        average.copy_(shared)

    def dense(self, keys, numels, grad):
        for store in (self.v, self.s, self.shared):
            store.pop(tuple(keys), None)
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


def main(stop: int, log: str, workload: str, seed: int = 0, beta=None) -> None:
    torch.set_num_threads(1)
    TRACK_BETA["beta"] = beta
    optim.DelayedMomentumSGD = EF21SGDM
    attach_of = simrun._attach

    def attach_without_feedback(spec, schedulers):
        attach = attach_of(spec, schedulers)

        def attach_rank(rank, replica, optimizer_, transport):
            engine = attach(rank, replica, optimizer_, transport)
            engine.error_feedback = False
            return engine

        return attach_rank

    simrun._attach = attach_without_feedback
    run_prefix(stop, log, workload, "sgdm", "topk", seed)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0,
         float(sys.argv[5]) if len(sys.argv) > 5 else None)
