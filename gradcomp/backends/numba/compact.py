"""Compact top-k's encode and check over every part of a group in one pass (the ``numba`` forms of
:data:`gradcomp.backends.FORMS`' ``"sparse_parts"``).

:class:`~gradcomp.backends.sparse_parts.CompactParts` writes and reads a group's compact entries with a few
dozen torch ops over the entries, each paying a dispatch: on charlm-small's 8,688 entries (a 2 % selection of
its 437K elements) about 0.9 ms to encode and 0.8 ms to check a payload, more than the top-k kernel's pass
over the elements. These loops do the same in one pass each and write and read the same bits (the tests
compare them with the torch forms on valid and corrupted payloads). They are serial: the work is a few
thousand entries, less than one fork-join of a parallel kernel.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from gradcomp.backends import implements_form
from gradcomp.backends.numba.common import f32_from_bits, f32_to_bf16_bits

CHUNK = 1 << 16  # elements per chunk: TopK.CHUNK


@njit(cache=True)
def encode_kernel(values, indices, out_bf16, out_local, out_counts, residual, k, value_slot, local_slot, offsets,
                  first_chunk, count_words):
    """Part ``p``'s entries ``values[e]``/``indices[e]`` (its own positions, ascending), parts one after
    another: bfloat16 values (round to nearest even) at ``value_slot[p] + j``, the low 16 bits of each index at
    ``local_slot[p] + j``, each chunk's count at ``count_words[c]``; ``residual`` (``None``: nothing) gains
    ``value - float32(bfloat16 value)`` at the entry's group position."""
    counts = np.zeros(count_words.size, np.int32)
    e = 0
    for p in range(k.size):
        for j in range(k[p]):
            index = np.int64(indices[e])
            bits = f32_to_bf16_bits(values[e])
            out_bf16[value_slot[p] + j] = bits
            if residual is not None:
                position = index + offsets[p]
                residual[position] = residual[position] + (values[e] - f32_from_bits(np.uint32(bits) << 16))
            low = index & (CHUNK - 1)
            out_local[local_slot[p] + j] = np.int16(low - ((low & 0x8000) << 1))
            counts[first_chunk[p] + index // CHUNK] += 1
            e += 1
    for c in range(count_words.size):
        out_counts[count_words[c]] = counts[c]


@njit(cache=True)
def entries_kernel(words, local16, bf16, k, value_slot, local_slot, first_chunk, count_words, chunk_part, chunk_base,
                   chunk_limit, positions, values):
    """Every part's entries into ``positions`` (group positions) and ``values`` (bfloat16 bits), in order;
    ``False`` (what is written then is garbage) unless every count is >= 0 and each part's add up to its
    ``k``, and every index lies inside its chunk with group positions strictly increasing."""
    per_part = np.zeros(k.size, np.int64)
    for c in range(count_words.size):
        count = words[count_words[c]]
        if count < 0:
            return False
        per_part[chunk_part[c]] += count
    for p in range(k.size):
        if per_part[p] != k[p]:
            return False
    e, last = 0, np.int64(-1)
    for p in range(k.size):
        j, c = 0, first_chunk[p]
        while j < k[p]:  # the part's chunks hold exactly k[p] entries (checked above)
            for _ in range(words[count_words[c]]):
                local = np.int64(local16[local_slot[p] + j]) & (CHUNK - 1)
                if local >= chunk_limit[c]:
                    return False
                position = chunk_base[c] + local
                if position <= last:
                    return False
                last = position
                positions[e] = position
                values[e] = bf16[value_slot[p] + j]
                j += 1
                e += 1
            c += 1
    return True


def _columns(parts, *names):
    return tuple(getattr(parts, name).numpy() for name in names)


@implements_form("sparse_parts", "compact_encode", "numba")
def compact_encode(parts, values: torch.Tensor, indices: torch.Tensor, buffer: torch.Tensor, residual_out) -> bool:
    """:meth:`CompactParts.encode <gradcomp.backends.sparse_parts.CompactParts.encode>` for float32 ``values``
    (``False``, nothing written: another dtype, left to the torch form)."""
    if values.dtype != torch.float32:
        return False
    encode_kernel(values.numpy(), indices.numpy(), buffer.view(torch.int16).numpy().view(np.uint16),
                  buffer.view(torch.int16).numpy(), buffer.view(torch.int32).numpy(),
                  None if residual_out is None else residual_out.numpy(),
                  *_columns(parts, "k", "values", "local", "offsets", "first_chunk", "count_words"))
    return True


@implements_form("sparse_parts", "compact_entries", "numba")
def compact_entries(parts, buffer: torch.Tensor):
    """:meth:`CompactParts.entries <gradcomp.backends.sparse_parts.CompactParts.entries>`: ``(group positions
    int64 [k], values bfloat16 [k])``, or ``None`` for a payload the check rejects."""
    total = int(parts.k.sum())
    positions = torch.empty(total, dtype=torch.int64)
    values = torch.empty(total, dtype=torch.int16)
    ok = entries_kernel(buffer.view(torch.int32).numpy(), buffer.view(torch.int16).numpy(),
                        buffer.view(torch.int16).numpy(),
                        *_columns(parts, "k", "values", "local", "first_chunk", "count_words", "chunk_part",
                                  "chunk_base", "chunk_limit"), positions.numpy(), values.numpy())
    return (positions, values.view(torch.bfloat16)) if ok else None
