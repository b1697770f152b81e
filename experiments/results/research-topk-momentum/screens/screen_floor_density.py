"""A diagnostic, not a recipe: the study's top-k under SGD-momentum with its density held at a floor after the ramp.

On the GPT every arrangement screened so far parts from dense where the ramp's density falls to 1/32-1/64. Holding
the density at ``FLOOR`` (``1/16``: the ramp's second stage) from there to the end asks whether the last 4 points of
the gap are the final density's (more bytes than the recipe's 8x budget allows: a measurement only).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_floor_density.py FLOOR STEPS LOG
WORKLOAD``
"""
import sys

import torch

from experiments.screening import run_prefix, with_density


def main(floor: float, stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    with_density(lambda step, density: max(density, floor))
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
