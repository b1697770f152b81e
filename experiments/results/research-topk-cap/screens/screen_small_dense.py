"""Top-k over the whole group with the small parameters always sent (PowerSGD and Dion keep 1-D
tensors dense): the study's top-k run (seed 0, its loop, length and recipe) where every element of a
parameter under 1024 elements (norm gains and biases) is among the entries sent each step, on top of
the top-k of the rest. Quality only: the recipe's byte accounting does not count the extra entries
(gpt: 896 small elements of 612736, 0.15 %; charlm-small: 3584 of 437760, 0.82 %).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-cap/screens/screen_small_dense.py STEPS LOG
[WORKLOAD [OPTIMIZER]]``
"""
import sys

import torch

from experiments.screening import run_prefix, topk_by_score
from gradcomp.compressors import TopK
from gradcomp.engine import Engine

SMALL = 1024


def main(stop: int, log: str, workload: str = "charlm-small", optimizer: str = "sgdm") -> None:
    torch.set_num_threads(1)
    masks = {}  # group numel -> bool mask of the small parameters' elements (groups differ in size here)
    start, k = Engine.start, TopK.k

    def noting(self, grad, keys, numels, group):
        if grad.numel() not in masks:
            masks[grad.numel()] = torch.cat([torch.full((n,), n < SMALL) for n in numels])
        return start(self, grad, keys, numels, group)

    def k_with_small(self, numel):
        small = int(masks[numel].sum()) if numel in masks else 0
        return min(numel, k(self, numel - small) + small) if small else k(self, numel)

    def always_small(acc):
        mask = masks.get(acc.numel())
        return acc.abs() if mask is None else torch.where(mask, torch.full_like(acc, float("inf")), acc.abs())

    def compress(self, tensor, residual=None, residual_out=None, backend=None):
        return topk_by_score(self, tensor, residual, residual_out, always_small)

    Engine.start, TopK.k, TopK.compress = noting, k_with_small, compress
    run_prefix(stop, log, workload, optimizer, "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
