"""A residual that cannot outgrow the gradient it compensates: the study's run (seed 0, its loop and
length; SGD-momentum unless named) through the recipe, with every group's committed residual ``e``
bounded before each compressed step, in the study's simulation of 2 ranks, patched from outside:

* ``norm``: scaled to at most the norm of that step's gradient ``g`` of the group
  (``e *= min(1, |g| / |e|)``);
* ``chunk-max``: each entry clamped to the largest magnitude of ``g`` in its chunk of 128 (3-bit's
  scale chunk), so no coordinate hands back more than the step's own largest entry there;
* ``decay:B``: multiplied by ``B`` every compressed step (DeMo decays its buffer), so what a
  coordinate held ``k`` steps ago counts ``B**k``.

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-threebit-adamw/screens/screen_residual.py VARIANT STEPS
LOG [WORKLOAD [OPTIMIZER [METHOD]]]`` (STEPS: where to stop, of the study's run; METHOD: the study's
``twobit`` unless named).
"""
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.engine import Engine


def clipped(compensate, variant: str):
    def run(self, handle, source):
        buffers = compensate(self, handle, source)
        if buffers is None:
            return buffers
        residual = buffers[0]
        if variant == "norm":
            grad_norm, norm = source.norm(), residual.norm()
            if norm > grad_norm:
                residual.mul_(grad_norm / norm)
        elif variant == "chunk-max":
            n = source.numel()
            padded = torch.nn.functional.pad(source.float().abs(), (0, (-n) % 128))
            bound = padded.view(-1, 128).amax(dim=1).repeat_interleave(128)[:n]
            torch.minimum(residual, bound, out=residual)
            torch.maximum(residual, -bound, out=residual)
        elif variant.startswith("decay:"):
            residual.mul_(float(variant.split(":")[1]))
        else:
            raise SystemExit(f"unknown variant {variant!r}")
        return buffers
    return run


def main(variant: str, stop: int, log: str, workload: str = "charlm-small", optimizer: str = "sgdm",
         method: str = "twobit") -> None:
    torch.set_num_threads(1)
    Engine._compensate = clipped(Engine._compensate, variant)
    run_prefix(stop, log, workload, optimizer, method)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])
