"""What a compact chunked top-k payload would buy under the recipe: the study's top-k run (seed 0, its loop and
length) with each group compressed chunk by chunk: every chunk of ``CHUNK`` = 256 elements sends its
``ceil(density * 256)`` largest entries as an 8-bit index inside the chunk and an 8-bit value scaled by the chunk's
largest sent magnitude (one float32 per chunk), the rounding error kept in the residual. An entry costs 2 bytes
(and 4 bytes a chunk) instead of 8, so the study's 8x budget keeps about four times as many entries; the recipe
derives its dense start, ramp and final density from that accounting. Written in torch, here only (the quality is
what is screened; the product's payload would need kernels, validation and checkpoints).

Usage, from the repository root:
``PYTHONPATH=. python experiments/results/research-topk-compact/screens/screen_chunked.py STEPS LOG WORKLOAD
[OPTIMIZER [VALUES]]`` (SGD-momentum unless named; VALUES ``int8`` (the default) or ``float`` (the chunked
selection alone, values sent exactly, still counted at 2 bytes an entry)).
"""
import math
import sys

import torch

from experiments import simrun
from experiments.screening import run_prefix
from gradcomp import recipe
from gradcomp.compressors import TopK, registry
from gradcomp.payload import PayloadLayout

CHUNK = 256
ENTRY_BYTES = 2.0
SCALE_BYTES = 4.0


class ChunkedTopK(TopK):
    """Top-k chunk by chunk, as the docstring above says; a TopK so that the recipe ramps its density."""

    exact_values = False

    def k(self, numel: int) -> int:
        return min(CHUNK, max(1, math.ceil(self.density * CHUNK)))

    def layout(self, numel, dtype):
        chunks, k = -(-numel // CHUNK), self.k(numel)
        return PayloadLayout((("values", torch.float32 if self.exact_values else torch.int8, chunks * k),
                              ("indices", torch.uint8, chunks * k), ("scales", torch.float32, chunks)))

    def compress(self, tensor, residual=None, residual_out=None, backend=None):
        n = tensor.numel()
        payload = self.layout(n, tensor.dtype).allocate(tensor.device)
        acc = tensor.float().reshape(-1) + (residual if residual is not None else 0)
        chunks, k = -(-n // CHUNK), self.k(n)
        padded = torch.zeros(chunks * CHUNK)
        padded[:n] = acc
        rows = padded.view(chunks, CHUNK)
        idx = rows.abs().topk(k, dim=1).indices.sort(dim=1).values
        picked = rows.gather(1, idx)
        scale = picked.abs().amax(dim=1) / 127.0
        if self.exact_values:
            sent = picked
            payload["values"].copy_(picked.reshape(-1))
        else:
            code = torch.where(scale[:, None] > 0, picked / scale.clamp_min(1e-38)[:, None], 0.0).round().clamp(-127, 127)
            sent = code * scale[:, None]
            payload["values"].copy_(code.reshape(-1).to(torch.int8))
        payload["indices"].copy_(idx.reshape(-1).to(torch.uint8))
        payload["scales"].copy_(scale)
        if residual_out is not None:
            rows = rows.clone()
            rows.scatter_(1, idx, rows.gather(1, idx) - sent)
            residual_out.copy_(rows.reshape(-1)[:n])
        return payload

    def check_payload(self, payload, numel):
        pass

    def sent_indices(self, payload):
        k = payload["indices"].numel() // payload["scales"].numel()
        base = torch.arange(payload["scales"].numel(), dtype=torch.int64).repeat_interleave(k) * CHUNK
        return base + payload["indices"].to(torch.int64)

    def decompress_add(self, payload, out, backend=None):
        k = payload["indices"].numel() // payload["scales"].numel()
        values = payload["values"].float()
        if not self.exact_values:
            values = values * payload["scales"].repeat_interleave(k)
        where = self.sent_indices(payload)
        keep = where < out.numel()
        out.index_add_(0, where[keep], values[keep])


def main(stop: int, log: str, workload: str, optimizer: str = "sgdm", values: str = "int8") -> None:
    torch.set_num_threads(1)
    ChunkedTopK.exact_values = values == "float"
    plain = recipe.bytes_per_element

    def compact(compressor, density, dense):
        if isinstance(compressor, TopK):
            d = density if density is not None else compressor.density
            k = min(CHUNK, max(1, math.ceil(d * CHUNK)))
            return dense + (1 - dense) * (k * ENTRY_BYTES + SCALE_BYTES) / (4 * CHUNK)
        return plain(compressor, density, dense)

    recipe.bytes_per_element = compact
    # 8 entries a chunk: 20 bytes a chunk, the study's 1 % at 8 bytes an entry (20.5)
    simrun.SPECS["topk"] = f"chunkedtopk:{8 / CHUNK}"
    registry.spec_name("chunkedtopk", params=("density",))(ChunkedTopK)
    run_prefix(stop, log, workload, optimizer, "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:])
