"""The recipe's byte accounting: what a step sends, as a share of dense float32 bytes.

The recipe's byte budget (``min_compression`` x fewer bytes than dense over the whole run) is a
promise, so the accounting reads each compressed parameter's own payload layout (the compressor's
:meth:`~gradcomp.compressors.Compressor.layout`: top-k's ``ceil(density * n)`` entries, compact
entries' counts per chunk, each segment's alignment) instead of an idealised bytes-per-entry figure.
Top-k's idealised 4 or 8 bytes an entry left the study's AdamW runs 0.01-0.2 % short of 8x (the
shapes CNN's three compressed tensors carry 2.4 % more than ``4 * density`` bytes an element with
compact entries). Per parameter is what Adam's stage compresses; a group compressed whole (top-k
under SGD) sends a little less, so the budget holds there too.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional, Tuple

import torch

from gradcomp.compressors import Compressor, ThreeBit, TopK, TwoBit, from_spec
from gradcomp.compressors.casts import Cast

__all__ = ["Traffic", "bytes_per_element"]

#: The tensor size the accounting assumes where a plan is made without the model's parameters.
NOMINAL_SIZE = 2**20


@dataclass(frozen=True)
class Traffic:
    """The averaged parameters as the byte accounting sees them.

    ``dense``: the share of their elements in parameters under ``min_numel``, which travel dense
    inside payloads; ``sizes``: the element counts of the others, which a compressor compresses.
    """

    dense: float = 0.0
    sizes: Tuple[int, ...] = (NOMINAL_SIZE,)

    @classmethod
    def of(cls, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], min_numel: int) -> "Traffic":
        """The traffic of ``named_parameters`` (those with ``requires_grad``); a model with none (or
        none at ``min_numel`` or more) keeps the nominal size."""
        sizes = [p.numel() for _, p in named_parameters if p.requires_grad]
        compressed = tuple(n for n in sizes if n >= min_numel)
        total = sum(sizes)
        return cls(sum(n for n in sizes if n < min_numel) / total if total else 0.0,
                   compressed or (NOMINAL_SIZE,))


def bytes_per_element(compressor: Compressor, density: Optional[float], traffic: Traffic) -> float:
    """Bytes sent per element as a share of dense float32: the elements of ``traffic.dense`` at 1,
    the others at their payloads' bytes (top-k at ``density`` where given, else its own; a cast at its
    wire dtype's, fp16 1/2); any other compressor at 1."""
    if isinstance(compressor, TopK) and density is not None:
        compressor = TopK(density, entries=compressor.entries)
    planned = isinstance(compressor, (TopK, TwoBit, ThreeBit, Cast))
    compressed = _payload_share(compressor.spec, traffic.sizes) if planned else 1.0
    return traffic.dense + (1 - traffic.dense) * compressed


@lru_cache(maxsize=4096)
def _payload_share(spec: str, sizes: Tuple[int, ...]) -> float:
    """Payload bytes of tensors of ``sizes`` elements over their float32 bytes under the compressor
    ``spec`` names (cached by spec: the planner asks for the same few densities many times over)."""
    compressor = from_spec(spec)
    return sum(compressor.layout(n, torch.float32).nbytes for n in sizes) / (4 * sum(sizes))
