"""Screen: top-k under SGD-momentum with the density held at FLOOR after the ramp and the sent values rounded
to bfloat16 (the rounding error kept in the residual): what a 4-byte entry (bf16 value, 16-bit index inside a
chunk) would deliver. Usage: screen_compact_floor.py FLOOR STEPS LOG WORKLOAD [ROUND(1/0)]"""
import json
import sys

import torch

from experiments.screening import run_prefix, with_density
from gradcomp.compressors import topk

SEEN = {}


def main(floor, stop, log, workload, rounding):
    torch.set_num_threads(1)

    def density_at(step, density):
        d = max(density, floor)
        if d not in SEEN:
            SEEN[d] = step
        return d

    with_density(density_at)
    if rounding:
        compress = topk.TopK.compress

        def rounded(self, tensor, residual=None, residual_out=None, backend=None):
            payload = compress(self, tensor, residual, residual_out, backend)
            values = payload["values"]
            kept = values.to(torch.bfloat16).to(values.dtype)
            if residual_out is not None:
                residual_out.index_add_(0, payload["indices"].long(), values - kept)
            values.copy_(kept)
            return payload

        topk.TopK.compress = rounded
    run_prefix(stop, log, workload, "sgdm", "topk")
    print(json.dumps({"first_step_of_density": SEEN}))


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) > 5 else 1)
