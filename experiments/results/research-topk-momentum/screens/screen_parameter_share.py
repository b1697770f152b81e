"""Top-k under SGD-momentum with each parameter's own share (the engine's default) instead of the group-wide
selection, now that ``DelayedMomentumSGD`` gives up error feedback's delay.

The group-wide selection was chosen before the stage existed (the GPT +9.4 % against +17.7 % with a share per
parameter, 1000 steps, seed 0). Under AdamW, where each parameter keeps its own share in update units and the
first moment gives up the same delay, top-k ends within 1.4 % of dense on every workload; this screen asks
whether the share per parameter is what SGD now lacks.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_parameter_share.py STEPS LOG
WORKLOAD``
"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp import recipe


def main(stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    recipe._granularity = lambda optimizer, compressor: None
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
