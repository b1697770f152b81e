"""Top-k over the whole group with each parameter's entries weighed by part of its own scale: the study's
top-k run (seed 0, its loop, length and recipe) selecting the group's ``k`` largest ``|acc_i| / s_p ** ALPHA``,
``s_p`` the RMS of parameter ``p``'s ``acc`` this step. ``ALPHA`` 0 is the study's group-wide selection (raw
magnitudes), 1 puts every parameter on one scale (close to a share per parameter). What is sent and
kept is unchanged (``acc`` at the chosen entries; ``e' = acc`` elsewhere), and so are the bytes.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-cap/screens/screen_scaled_selection.py ALPHA STEPS LOG
[WORKLOAD [OPTIMIZER]]``
"""
import sys

import torch

from experiments.screening import run_prefix, topk_by_score
from gradcomp.compressors import TopK
from gradcomp.engine import Engine


def main(alpha: float, stop: int, log: str, workload: str = "gpt", optimizer: str = "sgdm") -> None:
    torch.set_num_threads(1)
    layouts = {}  # group size -> the parameters' sizes, from the engine
    start = Engine.start

    def noting(self, grad, keys, numels, group):
        layouts[grad.numel()] = tuple(numels)
        return start(self, grad, keys, numels, group)

    def scaled(acc):
        numels = layouts.get(acc.numel())
        if numels is None or not alpha:
            return acc.abs()
        scales = torch.cat([torch.full((n,), float(piece.norm()) / n ** 0.5 + 1e-30)
                            for n, piece in zip(numels, acc.split(list(numels)))])
        return acc.abs() / scales ** alpha

    def compress(self, tensor, residual=None, residual_out=None, backend=None):
        return topk_by_score(self, tensor, residual, residual_out, scaled)

    Engine.start, TopK.compress = noting, compress
    run_prefix(stop, log, workload, optimizer, "topk")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
