"""Top-k's ops over every part of one flat group at once: the check, the decode and the compact encoding.

A per-parameter payload (:class:`~gradcomp.compressors.PerParameter`) of a :class:`~gradcomp.compressors.TopK`
base holds one top-k payload per parameter. Checked and decoded part by part, each part pays a few small torch
ops and a host sync, and a model has dozens of parts: on charlm-small (28 parameters) that was most of the
time compression took per step. The forms here read every part's entries with a handful of gathers over the
whole group, and agree bitwise with the per-part ops (the tests compare them on valid and hostile payloads):

* :class:`SparseParts` (wide entries: ``values`` in the gradient's dtype, ``indices`` int32 per part) and
  :class:`CompactParts` (compact entries: ``counts`` int32 per 65536-element chunk, ``values`` bfloat16,
  ``local`` int16 per part) each give :meth:`entries`: the group positions and values of every part's entries,
  or ``None`` unless every part passes the base's ``check_payload``. A payload that fails is checked again
  part by part, which names the part and the fault.
* :meth:`CompactParts.encode` writes every part's selection as compact entries at once, bitwise as
  :func:`~gradcomp.compressors.topk.compact_encode` part by part.

The compact forms are also :data:`~gradcomp.backends.FORMS`' ``"sparse_parts"``: a backend may register its own, bitwise
these (``numba``'s: one pass each, :mod:`gradcomp.backends.numba.compact`; ``cuda``'s: a few launches each,
:mod:`gradcomp.backends.cuda_compact`); the code here runs where it has none.

Every index tensor is int64 ``[parts]`` or ``[chunks]`` (a chunk is 65536 elements): a few numbers a
parameter, so a plan kept for every density of a ramp costs nothing next to the model. Buffers are read, not
mutated, except by :meth:`CompactParts.encode`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = ["SparseParts", "CompactParts", "signed16"]


def _owners(counts: torch.Tensor, total: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(owner, rank)`` (int64 ``[total]``) of ``total`` entries laid out ``counts[i]`` for owner ``i``."""
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts,
                                    output_size=total)
    rank = torch.arange(total, device=counts.device) - (torch.cumsum(counts, 0) - counts)[owner]
    return owner, rank


def _fast(op: str, device, backend: Optional[str]):
    """The resolved backend's form of ``op`` (``None``: the torch code here runs)."""
    from gradcomp.backends import form_kernel  # the registry imports this module's users

    return form_kernel("sparse_parts", op, device, backend)


def signed16(low: torch.Tensor) -> torch.Tensor:
    """``low`` (int64, each in ``[0, 65536)``: an index inside its chunk) as the int16 a compact payload
    stores: the same 16 bits, read back unsigned by ``& 0xFFFF``."""
    return (low - ((low & (1 << 15)) << 1)).to(torch.int16)


class SparseParts(NamedTuple):
    """A group's wide top-k parts (int64 ``[parts]`` each): entries, where the values (in the values' dtype)
    and the indices (int32) start in the buffer, the part's first element and element count."""
    counts: torch.Tensor
    values: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    limits: torch.Tensor

    def to(self, device) -> "SparseParts":
        return SparseParts(*(column.to(device) for column in self))

    def entries(self, buffer: torch.Tensor, dtype: torch.dtype, backend: Optional[str] = None
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(group positions int64 [k], values [k] in dtype)`` of every part's entries, or ``None`` unless each
        part's indices strictly increase inside ``[0, numel)``: the top-k check of every part in three
        reductions (as the parts' ranges follow one another, that is every index in its part's range and the
        group positions strictly increasing). ``buffer``: the payload's bytes (uint8); ``backend`` is
        :meth:`CompactParts.entries`' (these few ops run on every backend)."""
        words = buffer.view(torch.int32)
        owner, rank = _owners(self.counts, int(self.counts.sum()))
        local = words.index_select(0, self.indices[owner] + rank).long()
        group = local + self.offsets[owner]
        ok = bool((local >= 0).all() & (local < self.limits[owner]).all() & (group[1:] > group[:-1]).all())
        return (group, buffer.view(dtype).index_select(0, self.values[owner] + rank)) if ok else None


class CompactParts(NamedTuple):
    """A group's compact top-k parts: per part (int64 ``[parts]``) its entries ``k``, the bfloat16 slot of
    its first value and the int16 slot of its first ``local``, its first element in the group and its first
    chunk in the group's chunk numbering; per chunk (int64 ``[chunks]``) the int32 word of its count, its
    part, its first element in the group and its element count (65536, or less for a part's last)."""
    k: torch.Tensor
    values: torch.Tensor
    local: torch.Tensor
    offsets: torch.Tensor
    first_chunk: torch.Tensor
    count_words: torch.Tensor
    chunk_part: torch.Tensor
    chunk_base: torch.Tensor
    chunk_limit: torch.Tensor

    #: Elements per chunk: :attr:`gradcomp.compressors.TopK.CHUNK` (kept here too: backends import no compressor).
    CHUNK = 1 << 16

    @classmethod
    def of(cls, parts) -> "CompactParts":
        """The plan (CPU) of ``parts``: per compressed part, in the group's order, ``(k, the bfloat16 slot of its
        first value, the int16 slot of its first local, its first element in the group, its element count, the
        int32 word of its first count)``; a part of ``numel`` elements has ``ceil(numel / CHUNK)`` counts."""
        rows, chunks, first = [], [], 0
        for number, (k, values, local, offset, numel, counts) in enumerate(parts):
            rows.append((k, values, local, offset, first))
            spans = (numel + cls.CHUNK - 1) // cls.CHUNK
            chunks += [(counts + c, number, offset + c * cls.CHUNK, min(cls.CHUNK, numel - c * cls.CHUNK))
                       for c in range(spans)]
            first += spans
        columns = [[row[i] for row in rows] for i in range(5)] + [[chunk[i] for chunk in chunks] for i in range(4)]
        return cls(*(torch.tensor(column, dtype=torch.int64) for column in columns))

    def to(self, device) -> "CompactParts":
        return CompactParts(*(column.to(device) for column in self))

    def entries(self, buffer: torch.Tensor, dtype: torch.dtype = torch.bfloat16, backend: Optional[str] = None
                ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(group positions int64 [k], values bfloat16 [k])`` of every part's entries, or ``None`` unless
        every part's counts are >= 0 and add up to its ``k``, and its indices (a chunk's start plus the
        unsigned 16-bit ``local``) lie in its chunk and strictly increase: the compact top-k check of every
        part (``dtype`` is the gradient's, unused: compact values are bfloat16). ``backend``: whose form runs
        (:func:`~gradcomp.backends.form_kernel`; this torch code where it has none)."""
        fast = _fast("compact_entries", buffer.device, backend)
        if fast is not None:
            return fast(self, buffer)
        counts = buffer.view(torch.int32).index_select(0, self.count_words).long()
        per_part = torch.zeros_like(self.k).index_add_(0, self.chunk_part, counts)
        if bool((counts < 0).any() | (per_part != self.k).any()):
            return None
        chunk, _ = _owners(counts, int(self.k.sum()))  # the chunk of every entry, in order
        owner, entry = _owners(self.k, chunk.numel())  # its part, and its place among the part's entries
        local = buffer.view(torch.int16).index_select(0, self.local[owner] + entry).long() & (self.CHUNK - 1)
        group = self.chunk_base[chunk] + local
        ok = bool((local < self.chunk_limit[chunk]).all() & (group[1:] > group[:-1]).all())
        return (group, buffer.view(torch.bfloat16).index_select(0, self.values[owner] + entry)) if ok else None

    def encode(self, values: torch.Tensor, indices: torch.Tensor, buffer: torch.Tensor,
               residual_out: Optional[torch.Tensor], backend: Optional[str] = None) -> None:
        """Write every part's selection (``values`` ``[k]`` in the gradient's dtype, ``indices`` ``[k]`` each
        part's own ascending positions, parts one after another) as compact entries into ``buffer``
        (mutated); ``residual_out`` (float32 ``[n]``, mutated) receives what bfloat16 rounds off each value
        at its group position, on top of what the selection left there. ``backend``: as :meth:`entries`'."""
        fast = _fast("compact_encode", buffer.device, backend)
        if fast is not None and fast(self, values, indices, buffer, residual_out):
            return
        owner, entry = _owners(self.k, values.numel())
        sent = values.to(torch.bfloat16)  # round to nearest even, as every backend's bfloat16 store
        buffer.view(torch.bfloat16).index_copy_(0, self.values[owner] + entry, sent)
        wide = indices.to(torch.int64)
        if residual_out is not None:  # the positions are distinct, so an index_add_ is the element-wise sum
            residual_out.index_add_(0, wide + self.offsets[owner], values.to(torch.float32) - sent.to(torch.float32))
        buffer.view(torch.int16).index_copy_(0, self.local[owner] + entry, signed16(wide & (self.CHUNK - 1)))
        counts = torch.bincount(self.first_chunk[owner] + wide // self.CHUNK, minlength=self.count_words.numel())
        buffer.view(torch.int32).index_copy_(0, self.count_words, counts.to(torch.int32))
