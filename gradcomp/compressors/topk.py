"""Top-k sparsification: send the ``k`` entries of largest magnitude."""
from __future__ import annotations

import math
from typing import Optional

import torch

from gradcomp.backends import kernel
from gradcomp.backends.checks import topk_index_problem
from gradcomp.backends.sparse_parts import CompactParts, signed16
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.registry import spec_name
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import check_layout


@spec_name("topk", params=("density", "entries"))
class TopK(Compressor):
    """Exact top-k by magnitude, ``k = max(1, ceil(density * n))``.

    ``density`` is the fraction of entries kept (0.01 keeps 1%). Spec: ``"topk:0.01"``.
    Ties go to the lower index, so every backend selects the same set and the result is
    deterministic. ``entries`` chooses how an entry is written:

    * ``"wide"`` (default): ``values`` ``[k]`` in the gradient's dtype, then ``indices`` ``[k]``
      int32 (int64 when ``n >= 2**31``), ascending: 8 bytes an entry for float32.
    * ``"compact"`` (spec ``"topk:0.02,entries=compact"``): 4 bytes an entry, so the same bytes
      carry twice the entries: ``counts`` int32 ``[ceil(n / 65536)]`` (the entries in each chunk
      of :data:`CHUNK` elements), ``values`` ``[k]`` bfloat16 and ``local`` ``[k]`` int16 (the
      16 bits of each index inside its chunk), ascending. What bfloat16 rounds off a value stays
      in the residual. Under SGD-momentum the study's two transformers end +1.3 % / +0.9 % above
      dense at 1/50 with compact entries against +2.8 % / +2.4 % at 1/100 with wide ones, the same
      bytes (``experiments/results/research-topk-compact/``).
    """

    uses_error_feedback = True
    sparsifies = True

    DEFAULT_DENSITY = 0.01
    #: How an entry can be written (see the class docstring).
    ENTRIES = ("wide", "compact")
    #: Elements per chunk of a compact payload: an index inside a chunk fits 16 bits.
    CHUNK = 1 << 16

    def __init__(self, density: float = DEFAULT_DENSITY, *, entries: str = "wide"):
        #: The fraction of entries kept, in (0, 1].
        self.density = self._checked_density(density)
        if entries not in self.ENTRIES:
            raise ValueError(f"TopK(entries={entries!r}): an entry is written 'wide' or 'compact'")
        #: ``"wide"`` or ``"compact"``.
        self.entries = entries
        # The layouts and a compact payload's CompactParts, asked at every compress, check and decode and a few
        # Python objects each, are built once. Keyed by the settings too: a schedule's copy.copy shares these
        # dicts and sets another density.
        self._layouts: dict = {}
        self._plans: dict = {}

    @property
    def compact(self) -> bool:
        """Whether entries are written compact (4 bytes: a bfloat16 value, a 16-bit index in its chunk)."""
        return self.entries == "compact"

    @staticmethod
    def _checked_density(density) -> float:
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise TypeError(
                f"TopK(density=...) must be a number in (0, 1], got {type(density).__name__}"
            )
        if not math.isfinite(density) or not 0.0 < density <= 1.0:
            raise ValueError(
                f"TopK(density={density!r}): the fraction of entries kept must be finite "
                "and in (0, 1], e.g. 0.01 for 1%"
            )
        return float(density)

    def k(self, numel: int) -> int:
        """How many entries a ``[numel]`` tensor sends."""
        return min(numel, max(1, math.ceil(self.density * numel)))

    @staticmethod
    def index_dtype(numel: int) -> torch.dtype:
        return torch.int64 if numel >= 2**31 else torch.int32

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        key = (numel, dtype, self.density, self.entries)
        held = self._layouts.get(key)
        if held is not None:
            return held
        k = self.k(numel)
        if self.compact:
            chunks = (numel + self.CHUNK - 1) // self.CHUNK
            layout = PayloadLayout((("counts", torch.int32, chunks), ("values", torch.bfloat16, k),
                                    ("local", torch.int16, k)))
        else:
            layout = PayloadLayout((("values", dtype, k), ("indices", self.index_dtype(numel), k)))
        if len(self._layouts) >= 64:  # a ramp asks a few sizes per group; bounded anyway
            self._layouts.clear()
        self._layouts[key] = layout
        return layout

    def _compact_parts(self, numel: int, device) -> Optional[CompactParts]:
        """The :class:`~gradcomp.backends.sparse_parts.CompactParts` of a compact payload of ``[numel]`` (one part:
        its check, decode and encoding are then the per-parameter groups' fused ones), on ``device``; ``None``
        where those forms do not apply (wide entries, an empty tensor, int64 positions)."""
        if not self.compact or not 0 < numel < 2**31:
            return None
        key = (numel, str(device), self.density)
        plan = self._plans.get(key)
        if plan is None:
            at = {s.name: s.offset for s in self.layout(numel, torch.float32).segments}
            plan = CompactParts.of([(self.k(numel), at["values"] // 2, at["local"] // 2, 0, numel, at["counts"] // 4)])
            if len(self._plans) >= 64:
                self._plans.clear()
            plan = self._plans[key] = plan.to(device)
        return plan

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None) -> Payload:
        check_gradient(tensor)
        payload = self.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
        op = kernel("topk_compress", tensor.device, backend)
        if not self.compact:
            op(tensor, residual, residual_out, payload["values"], payload["indices"])
            return payload
        k = payload["values"].numel()
        values = torch.empty(k, dtype=tensor.dtype, device=tensor.device)
        indices = torch.empty(k, dtype=self.index_dtype(tensor.numel()), device=tensor.device)
        op(tensor, residual, residual_out, values, indices)
        plan = self._compact_parts(tensor.numel(), tensor.device)
        if plan is None:
            compact_encode(values, indices, payload, residual_out, self.CHUNK)
        else:  # bitwise compact_encode (tests/test_compressors.py), in one pass where the backend has it
            plan.encode(values, indices, payload.buffer, residual_out, backend)
        return payload

    def check_payload(self, payload: Payload, numel: int):
        """Raise ``ValueError`` unless the layout fits ``[numel]`` and the indices lie in
        ``[0, numel)`` strictly increasing (so no duplicates); compact: the chunks' counts add up
        to ``k`` first. O(k), one or two host syncs. Returns a compact payload's entries (positions int64
        ``[k]``, values bfloat16 ``[k]``) for :meth:`add_checked`, else ``None``."""
        dtype = check_layout(self, payload, numel)
        plan = self._compact_parts(numel, payload.buffer.device)
        if plan is not None:
            entries = plan.entries(payload.buffer, dtype)
            if entries is not None:
                return entries
        problem = topk_index_problem(self.sent_indices(payload), numel)
        if problem is not None:
            raise ValueError(problem)
        if plan is not None:
            raise AssertionError(f"{self!r}: the fused check rejected a payload the entry-wise check accepts")
        return None

    def add_checked(self, payload: Payload, checked, out: torch.Tensor, backend: Optional[str] = None) -> None:
        """``out += `` the entries :meth:`check_payload` returned (distinct positions: as the kernels,
        ``out[i] + value``); ``out`` float32 ``[n]`` is mutated."""
        positions, values = checked
        out.index_add_(0, positions, values.float())

    def sent_indices(self, payload: Payload) -> torch.Tensor:
        """The indices a payload sends: ``indices``, or a compact payload's decoded (int64; raises
        ``ValueError`` where its counts are not the ``k`` entries' chunks)."""
        if not self.compact:
            return payload["indices"]
        return compact_indices(payload["counts"], payload["local"], self.CHUNK)

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        plan = self._compact_parts(out.numel(), out.device)
        if plan is not None:  # the plan reads the buffer at [n]'s offsets: the layout must be [n]'s
            check_layout(self, payload, out.numel())
        entries = None if plan is None else plan.entries(payload.buffer, torch.float32)
        if entries is not None:
            self.add_checked(payload, entries, out, backend)
        else:  # wide entries, or a payload the fused check rejects: the kernel checks them and names the fault
            kernel("topk_decompress_add", out.device, backend)(payload["values"], self.sent_indices(payload), out)

    def __repr__(self) -> str:
        entries = ", entries='compact'" if self.compact else ""
        return f"TopK(density={self.density!r}{entries})"


def compact_encode(values: torch.Tensor, indices: torch.Tensor, payload: Payload,
                   residual_out: Optional[torch.Tensor], chunk: int) -> None:
    """Write a selection (``values`` ``[k]`` in the gradient's dtype, ``indices`` ``[k]`` ascending)
    as compact entries into ``payload`` (mutated); ``residual_out`` (float32 ``[n]``, mutated) receives
    what bfloat16 rounds off each value at its index, on top of what the selection left there (zero
    for float32 and bfloat16 gradients). O(k) torch ops, the same on every device and backend."""
    sent, wide = payload["values"], indices.to(torch.int64)
    sent.copy_(values)  # round to nearest even, as every backend's bfloat16 store
    if residual_out is not None:
        rounded = values.to(torch.float32) - sent.to(torch.float32)
        residual_out.index_put_((wide,), rounded, accumulate=True)
    payload["local"].copy_(signed16(wide & (chunk - 1)))
    counts = torch.bincount(wide // chunk, minlength=payload["counts"].numel())
    payload["counts"].copy_(counts[: payload["counts"].numel()])


def compact_indices(counts: torch.Tensor, local: torch.Tensor, chunk: int) -> torch.Tensor:
    """The indices (int64 ``[k]``) of compact entries: each chunk's start plus the 16-bit ``local``
    indices, the chunk of each entry from ``counts``. Raises ``ValueError`` unless ``counts`` are
    non-negative and add up to ``k`` (one host sync); whether the indices increase and fit the
    tensor is the caller's check (:func:`~gradcomp.backends.checks.topk_index_problem`)."""
    k = local.numel()
    counts = counts.to(torch.int64)
    if bool((counts < 0).any()) or int(counts.sum()) != k:
        raise ValueError(f"compact top-k: the chunks' counts {counts.tolist()[:8]} do not add up to "
                         f"{k} entries")
    starts = torch.arange(counts.numel(), dtype=torch.int64, device=local.device) * chunk
    return torch.repeat_interleave(starts, counts, output_size=k) + (local.to(torch.int64) & (chunk - 1))
