"""A screen: the study's top-k under SGD-momentum at one density ``DENSITY`` from the end of its dense start on,
in place of the ramp (1/8, 1/16, 1/32, 1/64 and the final 1/100).

The windows of ``screen_density_window.py`` found the GPT's gap made wherever the density is low, and fading
within ~100 steps of a denser stretch: the ramp spends half of the 8x budget on its first stages and leaves
1/100 for the last 40 % of the run. One density for the whole compressed run, as high as the budget allows
(1/26 after 5 % dense steps: ``50 + 950 x 2/26 = 123`` dense steps' bytes of the 125 an 8x budget allows),
asks whether the same bytes spread evenly serve better.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-momentum/screens/screen_flat_density.py DENSITY STEPS LOG
WORKLOAD``
"""
import sys

import torch

from experiments.screening import run_prefix, with_density


def main(density: float, stop: int, log: str, workload: str) -> None:
    torch.set_num_threads(1)
    with_density(lambda step, scheduled: density)
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
