"""Two diagnostics of a workload under SGD-momentum (seed 0, the study's loop and length; charlm-small
unless named), run in the study's simulation of 2 ranks with the recipe's set-up changed from outside:

* ``threebit-budget4``: 2-bit through the recipe (ThreeBit under SGD) with ``min_compression=4``,
  which lengthens the dense start to the recipe's 5 % (100 steps) at about 6.3x fewer bytes;
* ``twobit-chunk``: ``TwoBit("chunk")`` with the recipe's schedule at 8x (86 dense steps): the
  optimizer is not passed to the recipe, so it does not substitute ThreeBit (SGD has no stage).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-threebit-adamw/screens/screen_sgdm.py VARIANT STEPS LOG
[WORKLOAD]`` (STEPS: where to stop, of the study's run).
"""
import functools
import sys

import torch

import gradcomp.setup as setup
from experiments.screening import run_prefix


def main(variant: str, stop: int, log: str, workload: str = "charlm-small") -> None:
    torch.set_num_threads(1)
    prepare = setup.prepare
    if variant == "threebit-budget4":
        setup.prepare = functools.partial(prepare, min_compression=4.0)
    elif variant == "twobit-chunk":
        setup.prepare = lambda spec, named, optimizer=None, **kwargs: prepare(spec, named, **kwargs)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    run_prefix(stop, log, workload, "sgdm", "twobit")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
