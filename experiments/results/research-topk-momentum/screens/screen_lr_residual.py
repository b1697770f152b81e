"""Screen: top-k under SGD-momentum with the residual kept in learning-rate units (EF-SGD's p = lr * g + e):
before each compressed step every residual is multiplied by lr_prev / lr_now, so a gradient held back is applied
at the rate of the step it was computed in. Usage: screen_lr_residual.py STEPS LOG WORKLOAD [FLOOR]"""
import sys

import torch

from experiments.screening import run_prefix, with_density
from gradcomp import engine as engine_mod

LAST = {}


def main(stop, log, workload, floor):
    torch.set_num_threads(1)
    if floor > 0:
        with_density(lambda step, density: max(density, floor))
    compensate = engine_mod.Engine._compensate

    def rescaled(self, handle, source):
        buffers = compensate(self, handle, source)
        optimizer = getattr(self.transform, "optimizer", None)
        if buffers is not None and optimizer is not None:
            lr = float(optimizer.param_groups[0]["lr"])
            key = (id(self), handle.keys)
            prev = LAST.get(key)
            if prev is not None and prev != lr and lr > 0:
                buffers[0].mul_(prev / lr)
            LAST[key] = lr
        return buffers

    engine_mod.Engine._compensate = rescaled
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
