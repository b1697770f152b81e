"""A diagnostic, not a recipe: the study's top-k under SGD-momentum with its density held at ``FLOOR`` only
between steps ``START`` and ``END`` (the recipe's schedule elsewhere).

Holding 1/16 from the ramp's second stage to the end took the GPT from +4.6 % to +1.8 % above dense
(``screen_floor_density.py``). Holding it over one part of the run only asks which part the gap is made in:
the middle, at the high learning rates, or the end, where the cosine schedule has brought them down. Over the
8x budget: a measurement only.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_density_window.py FLOOR START END
STEPS LOG WORKLOAD``
"""
import sys

import torch

from experiments.screening import run_prefix, with_density


def main(floor: float, start: int, end: int, stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    with_density(lambda step, density: max(density, floor) if start <= step < end else density)
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
