"""What compact indices would buy top-k at the same bytes: the study's top-k run (seed 0, its loop and
length), with the recipe told that an entry costs 6 bytes (a float32 value and a 16-bit index inside
a chunk of 65536) instead of 8, so the same byte budget keeps 4/3 as many entries: the final density
1/75 in place of 1/100, and the ramp and dense start the recipe derives from that accounting. The
payload itself stays the 8-byte one (the quality is what is screened, not the bytes).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-compact/screens/screen_compact.py STEPS LOG
[WORKLOAD [OPTIMIZER [ENTRY_BYTES [SEED [VALUES]]]]]`` (SGD-momentum, 6 bytes, seed 0 and exact values unless
named; ``VALUES`` ``bf16`` rounds every sent value to bfloat16, the rounding error kept in the residual, as a
4-byte entry of a bfloat16 value and a 16-bit index would send; 3 bytes is an 8-bit value
with a 16-bit index, 2 bytes an 8-bit value with an 8-bit index inside a chunk of 256).
"""
import sys

import torch

from experiments import simrun
from experiments.screening import run_prefix
from gradcomp import recipe
from gradcomp.compressors import TopK, topk


def main(stop: int, log: str, workload: str = "charlm-small", optimizer: str = "sgdm",
         entry_bytes: str = "6", seed: str = "0", values: str = "exact") -> None:
    torch.set_num_threads(1)
    ENTRY_BYTES = float(entry_bytes)
    plain = recipe.bytes_per_element

    def compact(compressor, density, dense):
        if isinstance(compressor, TopK):
            d = density if density is not None else compressor.density
            return dense + (1 - dense) * (ENTRY_BYTES / 4) * d
        return plain(compressor, density, dense)

    recipe.bytes_per_element = compact
    if values == "bf16":
        compress = topk.TopK.compress

        def rounded(self, tensor, residual=None, residual_out=None, backend=None):
            payload = compress(self, tensor, residual, residual_out, backend)
            sent = payload["values"]
            kept = sent.to(torch.bfloat16).to(sent.dtype)
            if residual_out is None:
                raise SystemExit("screen_compact: bf16 values need the engine's separate residual output")
            residual_out.index_add_(0, payload["indices"].long(), sent - kept)
            sent.copy_(kept)
            return payload

        topk.TopK.compress = rounded
    simrun.SPECS["topk"] = f"topk:{0.01 * 8 / ENTRY_BYTES:.6g}"  # the study's 1 % at 8 bytes an entry
    run_prefix(stop, log, workload, optimizer, "topk", int(seed))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
