"""Exchange of fixed-size payloads between ranks, and their rank-ordered average.

Every rank decodes the same gathered bytes in the same order ``0..P-1``, so the
averaged gradient is bitwise identical on every rank.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from gradcomp import inflight
from gradcomp.compressors.base import Compressor
from gradcomp.payload import Payload, PayloadLayout

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; accept both.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group if group is not None else dist.group.WORLD)


def allgather_payload(payload: Payload, group: Optional[dist.ProcessGroup] = None) -> torch.futures.Future:
    """Start an allgather of ``payload.buffer``; the future's value is ``[gathered]``,
    a uint8 tensor of ``world_size * payload.nbytes`` bytes, rank ``r`` at ``r * nbytes``."""
    return allgather_bytes(payload.buffer, group)


def allgather_bytes(buffer: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.futures.Future:
    """Start an allgather of the 1-D uint8 ``buffer`` (the same size on every rank); the
    future's value is ``[gathered]``, uint8 ``[world_size * buffer.numel()]``."""
    group = group if group is not None else dist.group.WORLD
    gathered = torch.empty(group_size(group) * buffer.numel(), dtype=torch.uint8, device=buffer.device)
    # Held until Gloo's thread lets go of them, so it never needs the GIL at exit (see inflight).
    inflight.hold(buffer, gathered)
    work = _all_gather_flat(gathered, buffer, group=group, async_op=True)
    # The work's own future does not carry the output tensor on every backend (Gloo
    # gives back the input), so hand on the buffer we gathered into -- after value()
    # has re-raised any failure of the collective.
    def gathered_or_raise(fut: torch.futures.Future):
        fut.value()
        return [gathered]

    return work.get_future().then(inflight.watch(gathered_or_raise))


def payload_of_rank(layout: PayloadLayout, gathered: torch.Tensor, rank: int) -> Payload:
    """Rank ``rank``'s payload inside a gathered buffer (a view, no copy)."""
    return Payload(layout, gathered[rank * layout.nbytes : (rank + 1) * layout.nbytes])


def average_gathered(
    compressor: Compressor,
    layout: PayloadLayout,
    gathered: torch.Tensor,
    out: torch.Tensor,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """``out = (D(p_0) + D(p_1) + ... + D(p_{P-1})) / P``, summed in rank order in float32.

    Args:
        gathered: uint8 ``[P * layout.nbytes]`` from :func:`allgather_payload`.
        out: float32 ``[n]``, overwritten and returned.
    """
    world_size = gathered.numel() // layout.nbytes
    out.zero_()
    for rank in range(world_size):
        compressor.decompress_add(payload_of_rank(layout, gathered, rank), out, backend)
    return out.div_(world_size)
