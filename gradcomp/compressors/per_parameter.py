"""Per-parameter compression inside one flat group (a DDP bucket, a Horovod group).

DDP hands a communication hook buckets of ~25 MB that hold many parameters. Compressing the
bucket as one tensor lets its largest layer take the whole top-k budget and gives every
parameter the 2-bit scale of the bucket, which starves small parameters: on a held-out model the
per-bucket 2-bit scale cost +12% held-out loss that a scale per parameter recovered, at equal
bytes. :class:`PerParameter` applies the base compressor to each parameter's segment of the group
on its own, so top-k keeps ``max(1, ceil(density * n_i))`` entries of parameter ``i`` and the
2-bit ``"rms"`` scale is computed per parameter, exactly as if every parameter had a bucket of
its own.

Parameters smaller than ``dense_below`` elements (biases, norms) travel dense in the gradient's
dtype inside the same payload: their compressed payload would save a few bytes at most, and
sending them whole is what the engine does for groups under ``min_numel``. Error feedback still
holds for them (``e' = acc - dtype(acc)``: zero in float32).

Payload: the parts' payloads one after another, each the base compressor's own layout with its
segment names prefixed by the part's index (``"3.values"``, ``"3.indices"``), or one segment
``"<i>.dense"`` for a dense part. Every part starts on an 8-byte boundary, so each part is a
valid payload of its own (a view, no copy) for decoding and validation. The layout depends only on
the parameters' sizes, the dtype and the settings, so it is fixed for a group, the same on every
rank.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from gradcomp.backends import kernel, kernel_parts
from gradcomp.backends.parts import Part, PartIndex, Selection, part_index, parts_valid
from gradcomp.backends.sparse_parts import CompactParts, SparseParts
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.topk import TopK
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import check_layout

__all__ = ["PerParameter", "PerParameterCache"]


class _Part(NamedTuple):
    offset: int  # first element of the parameter in the flat group
    numel: int
    dense: bool  # sent whole, in the gradient's dtype


class _Plan(NamedTuple):
    """A group's payload for one dtype: the whole layout, each part's ``(byte offset, own layout)``, and for
    a base with batched ops (``part_ops``) the compressed parts' rows and their validation index (else
    ``None``: part by part)."""
    whole: PayloadLayout
    placed: List[Tuple[int, PayloadLayout]]
    batched: Optional[Tuple[Part, ...]]
    index: Optional[Dict[str, PartIndex]]
    #: The dense parts' elements in the group and their slots in the buffer viewed as the dtype (int64, one
    #: pair per device: a gather and a scatter for all of them), or ``None`` when no part is dense.
    dense: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]]
    #: A top-k base's parts, by device (:class:`SparseParts` or :class:`CompactParts`), or ``None``.
    sparse: Optional[Dict[str, Union[SparseParts, CompactParts]]]


class PerParameter(Compressor):
    """``base`` applied to each parameter segment of a flat group of ``numels`` on its own.

    Args:
        base: a non-summable compressor (``TopK``, ``TwoBit``); summable ones gain nothing.
        numels: element counts of the parameters laid out in the group, in order.
        dense_below: parameters with fewer elements are sent dense (>= 0).
    """

    def __init__(self, base: Compressor, numels: Sequence[int], dense_below: int = 0):
        if base.summable:
            raise TypeError(f"{base!r} is summable: compress its group whole")
        self.base = base
        self.numels: Tuple[int, ...] = tuple(int(n) for n in numels)
        self.dense_below = int(dense_below)
        self.uses_error_feedback = base.uses_error_feedback
        self.sparsifies = base.sparsifies
        #: A base with batched ops divides as its parts' kernels load (:attr:`Compressor.divides`).
        self.divides = base.part_ops is not None
        parts, offset = [], 0
        for n in self.numels:
            parts.append(_Part(offset, n, n < self.dense_below))
            offset += n
        self.parts: Tuple[_Part, ...] = tuple(parts)
        self.numel = offset
        self._layouts = {}
        self._selection_rows: Optional[Tuple[Selection, ...]] = None  # built at the first compact compress

    # -- layout ---------------------------------------------------------------------------
    def _plan(self, dtype: torch.dtype) -> _Plan:
        """The group's :class:`_Plan` for ``dtype`` (built once)."""
        cached = self._layouts.get(dtype)
        if cached is None:
            specs, placed, start = [], [], 0
            for index, part in enumerate(self.parts):
                own = (PayloadLayout(((f"{index}.dense", dtype, part.numel),)) if part.dense
                       else self.base.layout(part.numel, dtype))
                specs.extend((f"{index}.{s.name}" if not part.dense else s.name, s.dtype, s.numel)
                             for s in own.segments)
                placed.append((start, own))
                start += own.nbytes
            whole = PayloadLayout(tuple(specs))
            # Each part's segments keep their own offsets shifted by the part's start, because
            # every layout aligns segments and totals to 8 bytes.
            if whole.nbytes != start:
                raise AssertionError(f"part layouts do not tile: {whole.nbytes} != {start}")
            batched = index = None
            if self.base.part_ops is not None:  # codes then scales: their first int32 words in the buffer
                batched = tuple(Part(part.offset, part.numel, (at + own.segments[0].offset) // 4,
                                     (at + own.segments[1].offset) // 4)
                                for part, (at, own) in zip(self.parts, placed) if not part.dense)
                index = {"cpu": part_index(self.base.part_ops[0], batched)}
            cached = self._layouts[dtype] = _Plan(whole, placed, batched, index, self._dense_plan(placed, dtype),
                                                  self._sparse_plan(placed, dtype))
        return cached

    def _sparse_plan(self, placed, dtype: torch.dtype) -> Optional[Dict[str, Union[SparseParts, CompactParts]]]:
        """:attr:`_Plan.sparse` of the parts ``placed``: for a :class:`TopK` base with int32 indices."""
        if type(self.base) is not TopK or self.numel >= 2**31:
            return None
        kept = [(part, at, {s.name: s for s in own.segments})
                for part, (at, own) in zip(self.parts, placed) if not part.dense]
        if not kept:
            return None
        if self.base.compact:
            assert TopK.CHUNK == CompactParts.CHUNK, "compact chunks differ between the payload and its plan"
            return {"cpu": self._compact_plan(kept)}
        rows = [(own["values"].numel, (at + own["values"].offset) // dtype.itemsize,
                 (at + own["indices"].offset) // 4, part.offset, part.numel) for part, at, own in kept]
        return {"cpu": SparseParts(*(torch.tensor(column) for column in zip(*rows)))}

    @staticmethod
    def _compact_plan(kept) -> CompactParts:
        """The :class:`CompactParts` of the compressed parts ``kept`` (``(part, byte offset, segments by name)``)."""
        return CompactParts.of([(own["values"].numel, (at + own["values"].offset) // 2, (at + own["local"].offset) // 2,
                                 part.offset, part.numel, (at + own["counts"].offset) // 4) for part, at, own in kept])

    def _dense_plan(self, placed, dtype: torch.dtype) -> Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]]:
        """:attr:`_Plan.dense` of the parts ``placed`` (each a dense part's values at its start)."""
        pairs = [(torch.arange(part.offset, part.offset + part.numel),
                  torch.arange(at // dtype.itemsize, at // dtype.itemsize + part.numel))
                 for part, (at, _) in zip(self.parts, placed) if part.dense]
        return {"cpu": tuple(torch.cat(column) for column in zip(*pairs))} if pairs else None

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        if numel != self.numel:
            raise ValueError(f"{self!r} lays out {self.numel} elements, asked for {numel}")
        return self._plan(dtype).whole

    def parts_of(self, payload: Payload, dtype: Optional[torch.dtype] = None) -> List[Tuple[_Part, Payload]]:
        """Each part with its own payload, a view into ``payload``'s buffer."""
        dtype = dtype if dtype is not None else check_layout(self, payload, self.numel)
        placed = self._plan(dtype).placed
        return [(part, Payload(own, payload.buffer[start:start + own.nbytes]))
                for part, (start, own) in zip(self.parts, placed)]

    # -- compress / decode ------------------------------------------------------------------
    @staticmethod
    def _on(held: dict, device):
        """A plan's index tensors on ``device`` (copied there once)."""
        found = held.get(str(device))
        if found is None:
            cpu = held["cpu"]
            moves = isinstance(cpu, (PartIndex, SparseParts, CompactParts))  # else a tuple of index tensors
            found = held[str(device)] = cpu.to(device) if moves else tuple(index.to(device) for index in cpu)
        return found

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None,
                 divisor: Optional[torch.Tensor] = None) -> Payload:
        """Each part compressed on its own (see :meth:`Compressor.compress`); ``tensor`` is not
        mutated, ``residual_out`` receives every part's ``acc - decompress``. The dense parts are
        written by one gather and one scatter, and a base with batched ops compresses every other part in
        one call, bitwise as part by part. ``divisor`` (float32 ``[n]``, only where :attr:`divides`): every part
        compresses ``float32(tensor) / divisor + residual``."""
        check_gradient(tensor)
        if divisor is not None and not self.divides:
            raise TypeError(f"{self!r} takes no divisor: its base has no batched ops")
        plan = self._plan(tensor.dtype)
        payload = plan.whole.allocate(tensor.device)
        if plan.batched:
            extra = {} if divisor is None else {"divisor": divisor}
            kernel_parts(self.base.part_ops[0], tensor.device, backend)(
                tensor, residual, residual_out, payload.buffer.view(torch.int32), plan.batched, **extra)
        # A base whose compress is replaced on the instance (wrapped to instrument or to test a hostile peer)
        # is called part by part, as a subclass is: the batched path runs TopK's own kernel and encoding.
        elif plan.sparse is not None and "compress" not in vars(self.base):
            self._sparse_compress(tensor, residual, residual_out, payload, plan, backend)
        elif plan.batched is None:
            for part, own in self.parts_of(payload, tensor.dtype):
                if not part.dense:
                    # The base writes its own small payload (its kernels allocate it); copying k
                    # entries into place costs nothing next to the pass over the part.
                    piece = slice(part.offset, part.offset + part.numel)
                    own.buffer.copy_(self.base.compress(
                        tensor[piece], None if residual is None else residual[piece],
                        None if residual_out is None else residual_out[piece], backend=backend).buffer)
        if plan.dense is not None:
            elements, slots = self._on(plan.dense, tensor.device)
            acc = tensor.index_select(0, elements).float()
            if divisor is not None:
                acc = acc / divisor.index_select(0, elements)
            if residual is not None:
                acc = acc + residual.index_select(0, elements)
            values = acc.to(tensor.dtype)
            payload.buffer.view(tensor.dtype).index_copy_(0, slots, values)
            if residual_out is not None:
                residual_out.index_copy_(0, elements, acc - values.float())
        return payload

    def _sparse_compress(self, tensor, residual, residual_out, payload: Payload, plan: _Plan, backend) -> None:
        """Every top-k part selected by the base's kernel straight into its own segments (wide entries), or
        into one selection of the group that :meth:`CompactParts.encode` writes at once (compact entries):
        bitwise the base's ``compress`` part by part, without a payload allocated and copied per part."""
        if self.base.compact:  # every part's selection in one call (kernel_parts), then encoded at once
            selections = self._selections()
            total = sum(row.k for row in selections)
            values = torch.empty(total, dtype=tensor.dtype, device=tensor.device)
            indices = torch.empty(total, dtype=torch.int32, device=tensor.device)
            kernel_parts("topk_compress", tensor.device, backend)(tensor, residual, residual_out, values, indices,
                                                                  selections)
            self._on(plan.sparse, tensor.device).encode(values, indices, payload.buffer, residual_out, backend)
            return
        op = kernel("topk_compress", tensor.device, backend)
        for part, own in self.parts_of(payload, tensor.dtype):
            if not part.dense:
                piece = slice(part.offset, part.offset + part.numel)
                op(tensor[piece], None if residual is None else residual[piece],
                   None if residual_out is None else residual_out[piece], own["values"], own["indices"])

    def _selections(self) -> Tuple[Selection, ...]:
        """The top-k parts' :class:`~gradcomp.backends.parts.Selection` rows, entries one part after another (an
        empty part selects nothing and has none)."""
        if self._selection_rows is None:
            rows, first = [], 0
            for part in self.parts:
                k = 0 if part.dense else self.base.k(part.numel)
                if k:
                    rows.append(Selection(part.offset, part.numel, first, k))
                    first += k
            self._selection_rows = tuple(rows)
        return self._selection_rows

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        self.add_checked(payload, None, out, backend)

    def add_checked(self, payload: Payload, checked, out: torch.Tensor, backend: Optional[str] = None) -> None:
        """``out += decompress(payload)``; ``checked``: the top-k parts' entries :meth:`check_payload` returned
        for this payload (``None``: decoded here)."""
        dtype = check_layout(self, payload, self.numel)
        plan = self._plan(dtype)
        if plan.batched:
            kernel_parts(self.base.part_ops[1], out.device, backend)(payload.buffer.view(torch.int32),
                                                                     plan.batched, out)
        elif plan.sparse is not None and self._sparse_add(payload, plan, dtype, out, checked, backend):
            pass
        elif plan.batched is None:
            for part, own in self.parts_of(payload, dtype):
                if not part.dense:
                    self.base.decompress_add(own, out[part.offset:part.offset + part.numel], backend)
        if plan.dense is not None:
            elements, slots = self._on(plan.dense, out.device)
            out.index_add_(0, elements, payload.buffer.view(dtype).index_select(0, slots).float())

    @property
    def averages(self) -> bool:
        """A base with batched ops averages every rank's payload in one call (:meth:`average`)."""
        return self.base.part_ops is not None

    def average(self, layout: PayloadLayout, gathered: torch.Tensor, out: torch.Tensor, backend: Optional[str] = None,
                multiplier: Optional[torch.Tensor] = None) -> Optional[bool]:
        """``out = (D(p_0) + ... + D(p_{P-1})) / P``, times ``multiplier`` (float32 ``[n]``) where given: one call of
        the base's ``average`` op for the compressed parts and the dense ones, bitwise the rank-by-rank decode of
        :func:`~gradcomp.exchanges.base.average_gathered`, each element written once. Only where :attr:`averages`.

        Args:
            gathered: uint8 ``[P * layout.nbytes]``, rank ``r``'s payload at ``r * layout.nbytes`` (validated).
            out: float32 ``[n]``, overwritten.
        Returns:
            whether every element of ``out`` is finite, or ``None`` where the backend's form does not say.
        """
        nbytes = layout.nbytes
        dtype = check_layout(self, Payload(layout, gathered[:nbytes]), self.numel)
        plan, world_size = self._plan(dtype), gathered.numel() // nbytes
        dense = None
        if plan.dense is not None:  # each rank's values, the payload viewed as the dtype, one rank a row
            dense = (gathered.view(dtype).view(world_size, -1), *self._on(plan.dense, out.device))
        return kernel_parts(self.base.part_ops[2], out.device, backend)(
            gathered.view(torch.int32).view(world_size, -1), plan.batched, out, multiplier, dense)

    def _sparse_add(self, payload: Payload, plan: _Plan, dtype: torch.dtype, out: torch.Tensor,
                    entries=None, backend: Optional[str] = None) -> bool:
        """``out += `` every top-k part's entries (``entries`` if the check already read them) in one
        ``index_add_`` (as the kernels, ``out[i] + value``), if every part's indices are valid; ``False``
        (nothing written) if not."""
        if entries is None:
            entries = self._on(plan.sparse, out.device).entries(payload.buffer, dtype, backend)
        if entries is None:
            return False
        out.index_add_(0, entries[0], entries[1].float())
        return True

    def check_payload(self, payload: Payload, numel: int):
        """The layout, then every compressed part by the base's own check (dense parts carry
        plain values: a non-finite one only makes the step's average non-finite). A base with batched
        ops checks every part in a few reductions first; only a payload that fails them is checked part
        by part, for the message. Returns a top-k group's checked entries (group positions int64 ``[k]``,
        values ``[k]``) for :meth:`add_checked`, else ``None``."""
        dtype = check_layout(self, payload, numel)
        plan = self._plan(dtype)
        words = payload.buffer.view(torch.int32)
        if plan.index is not None and parts_valid(words, self._on(plan.index, words.device)):
            return
        if plan.sparse is not None:
            entries = self._on(plan.sparse, words.device).entries(payload.buffer, dtype)
            if entries is not None:
                return entries  # the decode adds these (add_checked) rather than reading the bytes again
        for number, (part, own) in enumerate(self.parts_of(payload, dtype)):
            if not part.dense:
                try:
                    self.base.check_payload(own, part.numel)
                except ValueError as error:
                    raise ValueError(f"parameter {number} of the group ({part.numel} elements): {error}") from error
        if plan.index is not None or plan.sparse is not None:
            raise AssertionError(f"{self!r}: the batched check rejected a payload every part's check accepts")

    def sent_indices(self, payload: Payload) -> Optional[torch.Tensor]:
        """Group positions the compressed parts sent whole (int64), for a sparsifying base."""
        if not self.sparsifies:
            return None
        dtype = check_layout(self, payload, self.numel)
        sparse = self._plan(dtype).sparse
        entries = None if sparse is None else self._on(sparse, payload.buffer.device).entries(payload.buffer, dtype)
        if entries is not None:
            return entries[0]
        found = [self.base.sent_indices(own).to(torch.int64) + part.offset
                 for part, own in self.parts_of(payload) if not part.dense]
        if not found:
            return torch.zeros(0, dtype=torch.int64, device=payload.buffer.device)
        return torch.cat(found)

    def unwrapped(self) -> Compressor:
        return self.base

    def __repr__(self) -> str:
        return f"PerParameter({self.base!r}, {len(self.numels)} parameters, dense_below={self.dense_below})"


class PerParameterCache:
    """:class:`PerParameter` wrappers by base compressor and layout, so that a group's layouts are
    built once (a schedule hands out a few compressors; the cache is bounded anyway)."""

    LIMIT = 256

    def __init__(self):
        self._wrapped = {}

    def get(self, base: Compressor, numels: Tuple[int, ...], dense_below: int) -> PerParameter:
        key = (id(base), numels, dense_below)
        wrapped = self._wrapped.get(key)
        if wrapped is None or wrapped.base is not base:  # an id reused by a new compressor
            if len(self._wrapped) >= self.LIMIT:
                self._wrapped.clear()
            wrapped = self._wrapped[key] = PerParameter(base, numels, dense_below)
        return wrapped
