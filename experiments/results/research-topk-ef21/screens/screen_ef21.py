"""Top-k as EF21 (Richtarik et al. 2021; EF21-SGDM, Fatkhullin et al. 2023): each rank sends a compressed
*difference* to the state it last sent, in place of a compressed gradient plus a residual.

Each rank ``i`` keeps ``s_i`` (float32 ``[n]`` per group, what its peers know of its gradient); every rank
keeps ``S`` (the average of the ``s_i``, bitwise the same on every rank: it is built from the averaged
payloads). A compressed step sends ``C(g_i - s_i)``, then ``s_i += C(g_i - s_i)`` and ``S += average``;
``.grad`` receives ``S`` (gradient units: an estimate of the average gradient, dense, every coordinate at
its last sent value), and the user's SGD-momentum runs on it as on dense's. No residual is kept: what is
not sent stays in ``g_i - s_i`` and is offered again next step. A dense step sets ``s_i = g_i``, ``S`` = the
average. Same payloads, same bytes as the study's top-k.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-ef21/screens/screen_ef21.py STEPS LOG [WORKLOAD [OPTIMIZER [MOMENTUM]]]``
(``MOMENTUM``, optional: ``ETA`` runs EF21-SGDM's local momentum ``v_i = (1 - ETA) v_i + ETA g_i`` before the
difference; default none, ``v_i = g_i``).
"""
import sys

import torch

from experiments import simrun
from experiments.screening import run_prefix


class EF21:
    """The engine's transform slot (``gradcomp.engine``) holding one rank's ``s_i`` and the shared ``S``,
    around the recipe's own stage (``inner``: ``FrozenVarianceAdam`` under Adam, ``None`` under SGD), whose
    units it then tracks (Adam: each rank's first moment over the frozen denominator). The first compressed
    step of a group starts from ``s_i = S = 0`` when the dense steps were in other units (Adam's freeze)."""

    def __init__(self, inner=None, eta: float = 1.0):
        self.inner, self.eta = inner, eta
        self.own, self.shared, self.velocity = {}, {}, {}

    @property
    def suspended(self):
        return getattr(self.inner, "suspended", False)

    def _momentum(self, keys, g: torch.Tensor) -> torch.Tensor:
        if self.eta >= 1.0:
            return g
        v = self.velocity.get(keys)
        v = g.clone() if v is None else v.mul_(1 - self.eta).add_(g, alpha=self.eta)
        self.velocity[keys] = v
        return v

    def dense(self, keys, numels, g):
        v = self._momentum(keys, self.inner.dense(keys, numels, g) if self.inner else g)
        # Adam's dense steps before the freeze are in gradient units: its compressed ones start from zero
        self.own[keys] = v.clone() if self.inner is None else None
        return v.clone()

    def before_compress(self, keys, numels, g):
        v = self._momentum(keys, self.inner.before_compress(keys, numels, g) if self.inner else g)
        s = self.own.get(keys)
        if s is None:
            self.shared[keys] = None
        return v - s if s is not None else v.clone()

    def after_compress(self, keys, payload, compressor, numel):
        sent = compressor.decompress(payload, torch.zeros(numel))
        s = self.own.get(keys)
        self.own[keys] = sent if s is None else s.add_(sent)

    def after_average(self, keys, numels, average, dense):
        if dense:
            self.shared[keys] = average.float().clone()
        else:
            s = self.shared.get(keys)
            s = average.float().clone() if s is None else s.add_(average.float())
            self.shared[keys] = s
            average.copy_(s)
        if self.inner is not None:
            self.inner.after_average(keys, numels, average, dense)

    def commit(self, keys, accept):
        if self.inner is not None:
            self.inner.commit(keys, accept)


def main(stop: int, log: str, workload: str = "gpt", optimizer: str = "sgdm", eta: str = "1") -> None:
    torch.set_num_threads(1)
    attach_of = simrun._attach

    def ef21_attach(spec, schedulers):
        attach = attach_of(spec, schedulers)

        def attach_ef21(rank, replica, optimizer_, transport):
            engine = attach(rank, replica, optimizer_, transport)
            engine.transform, engine.error_feedback = EF21(engine.transform, float(eta)), False
            return engine

        return attach_ef21

    simrun._attach = ef21_attach
    run_prefix(stop, log, workload, optimizer, "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
