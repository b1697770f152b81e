"""The frozen-variance Adam's step under a bound, and what the unbounded steps look like, on the study's top-k run.

* ``units``: no change; records, at every compressed step and for each rank's group, the median and largest
  ``|m_i / d|`` (update units) of what the rank compresses and the share of coordinates above 1 and 3
  (written to ``LOG`` with ``.units.json`` in place of ``.jsonl``).
* ``coordinate=B``: each coordinate of what a rank compresses clipped to ``[-B, B]`` (``B`` = 3, or 7.27, the
  largest step Adam itself takes at betas 0.9/0.999).
* ``rms``: the stage with ``bounded=True`` (each parameter's step share scaled back to root mean square 1).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-adam-bound/screens/screen_bound.py VARIANT WORKLOAD SEED STEPS LOG``
"""
import json
import sys

import torch

from experiments.screening import run_prefix
from gradcomp.optim import frozen_adam


def main(variant: str, workload: str, seed: int, stop: int, log: str) -> None:
    stage = frozen_adam.FrozenVarianceAdam
    before_compress, init, units = stage.before_compress, stage.__init__, []

    def unbounded_init(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "bounded": variant == "rms"})

    def patched(self, keys, numels, grad, compressor=None):
        out = before_compress(self, keys, numels, grad, compressor)
        pieces = [piece for _, _, _, piece in self._pieces(keys, numels, out)]
        if pieces and variant == "units":
            size = torch.cat([piece.abs() for piece in pieces])
            units.append((float(size.median()), float(size.max()), float((size > 1).float().mean()),
                          float((size > 3).float().mean())))
        if variant.startswith("coordinate="):
            bound = float(variant.split("=")[1])
            for piece in pieces:
                piece.clamp_(-bound, bound)
        return out

    stage.__init__, stage.before_compress = unbounded_init, patched
    run_prefix(stop, log, workload, "adamw", "topk", seed)
    if variant == "units":
        with open(log[: -len(".jsonl")] + ".units.json", "w") as f:
            json.dump(units, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
