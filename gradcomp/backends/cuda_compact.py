"""Launch plans of compact top-k's encode and check over every part of a group on a GPU (``csrc/compact.cu``):
the ``cuda`` forms of :data:`gradcomp.backends.FORMS`' ``"sparse_parts"``.

:class:`~gradcomp.backends.sparse_parts.CompactParts`' torch forms take a few dozen small ops each (a kernel
launch apiece on a GPU); these take two launches to encode and three to check, and write and read the same
bits (the tests run them in the CPU emulation against the torch forms, on valid and corrupted payloads).
The check reads its verdict back to the host once, as the torch form does; it also needs the entry count on
the host to size its output, one more read of the plan's ``k``.

Plain functions of a ``launch`` callable (:mod:`gradcomp.backends.cuda_launch`), so that the tests run the very
plans a GPU runs; :mod:`gradcomp.backends.cuda_ops` registers them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy
import torch

from gradcomp.backends.cuda_launch import Launch, LaunchConfig, pointer

__all__ = ["plan_compact_encode", "plan_compact_entries"]


def _ends(parts) -> torch.Tensor:
    """The inclusive prefix sums of the parts' entry counts (int64 ``[parts]``, on the plan's device)."""
    return torch.cumsum(parts.k, 0)


def plan_compact_encode(launch: Launch, config: LaunchConfig, parts, values: torch.Tensor, indices: torch.Tensor,
                        buffer: torch.Tensor, residual_out: Optional[torch.Tensor]) -> bool:
    """:meth:`CompactParts.encode <gradcomp.backends.sparse_parts.CompactParts.encode>` for float32 ``values``
    and int32 ``indices`` (``False``, nothing written, for other dtypes: the torch form runs).

    ``parts``: the group's :class:`~gradcomp.backends.sparse_parts.CompactParts` on the tensors' device;
    ``buffer`` (the payload's bytes, mutated) and ``residual_out`` (float32 ``[n]`` or ``None``, mutated)."""
    if values.dtype != torch.float32 or indices.dtype != torch.int32:
        return False
    total, count, chunks = values.numel(), parts.k.numel(), parts.count_words.numel()
    if total != indices.numel() or not (values.is_contiguous() and indices.is_contiguous()):
        raise ValueError(f"compact encode: {total} values and {indices.numel()} indices, both contiguous")
    ends = _ends(parts)
    if total:
        launch("gradcomp_compact_encode", config.blocks(total), config.threads,
               (pointer(values), pointer(indices), pointer(buffer), pointer(residual_out), pointer(ends),
                pointer(parts.k), pointer(parts.values), pointer(parts.local), pointer(parts.offsets),
                numpy.int64(count), numpy.int64(total)))
    if chunks:
        launch("gradcomp_compact_counts", config.blocks(chunks), config.threads,
               (pointer(indices), pointer(buffer), pointer(ends), pointer(parts.k), pointer(parts.first_chunk),
                pointer(parts.count_words), pointer(parts.chunk_part), numpy.int64(chunks)))
    return True


def plan_compact_entries(launch: Launch, config: LaunchConfig, parts, buffer: torch.Tensor
                         ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:meth:`CompactParts.entries <gradcomp.backends.sparse_parts.CompactParts.entries>`: ``(group positions
    int64 [k], values bfloat16 [k])`` of every part's entries in ``buffer`` (the payload's bytes, read only), or
    ``None`` for a payload the check rejects (counts, their totals, an index outside its chunk, positions not
    strictly increasing)."""
    device, count, chunks = buffer.device, parts.k.numel(), parts.count_words.numel()
    ends = _ends(parts)
    total = int(ends[-1]) if count else 0  # sizes the output: one read of the plan back to the host
    positions = torch.empty(total, dtype=torch.int64, device=device)
    values = torch.empty(total, dtype=torch.int16, device=device)
    starts = torch.empty(chunks, dtype=torch.int64, device=device)
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    launch("gradcomp_compact_chunk_starts", config.blocks(count), config.threads,
           (pointer(buffer), pointer(parts.k), pointer(parts.first_chunk), pointer(parts.count_words),
            pointer(starts), pointer(bad), numpy.int64(count), numpy.int64(chunks)))
    if total:
        launch("gradcomp_compact_entries", config.blocks(total), config.threads,
               (pointer(buffer), pointer(ends), pointer(parts.k), pointer(parts.values), pointer(parts.local),
                pointer(parts.first_chunk), pointer(parts.chunk_base), pointer(parts.chunk_limit), pointer(starts),
                pointer(positions), pointer(values), pointer(bad), numpy.int64(count), numpy.int64(chunks),
                numpy.int64(total)))
        launch("gradcomp_compact_increasing", config.blocks(total), config.threads,
               (pointer(positions), pointer(bad), numpy.int64(total)))
    return None if bool(bad.item()) else (positions, values.view(torch.bfloat16))
