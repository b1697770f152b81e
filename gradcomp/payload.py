"""Fixed-size payloads: one contiguous byte buffer cut into typed segments.

A compressor describes its payload as a :class:`PayloadLayout` that depends only on
``(numel, dtype, settings)``, never on the data. Every rank therefore sends the same
number of bytes, so payloads can be allgathered into one flat buffer with no size
exchange, and rank ``r``'s payload is simply bytes ``[r * nbytes, (r + 1) * nbytes)``.

Kernels write straight into the segment views of the buffer, so packing a payload for
the wire costs no copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

# Every segment starts on an 8-byte boundary so that a view of any dtype is aligned,
# and the total is a multiple of 8 so that the buffer can also travel as int32/int64
# (Horovod's CPU collectives reject int8).
_ALIGN = 8


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Segment:
    """One typed slice of a payload: ``numel`` elements of ``dtype`` at byte ``offset``."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int

    @property
    def nbytes(self) -> int:
        # dtype.itemsize, not a scratch tensor's element_size(): layouts are read on every
        # compress, and an allocation per read was a measurable share of a small model's step.
        return self.numel * self.dtype.itemsize


class PayloadLayout:
    """The byte layout of a payload, built from ``(name, dtype, numel)`` specs in order."""

    def __init__(self, specs: Tuple[Tuple[str, torch.dtype, int], ...]):
        segments = []
        offset = 0
        for name, dtype, numel in specs:
            segment = Segment(name, dtype, int(numel), offset)
            segments.append(segment)
            offset = _round_up(offset + segment.nbytes, _ALIGN)
        self.segments: Tuple[Segment, ...] = tuple(segments)
        self.nbytes: int = max(offset, _ALIGN)
        # The alignment gaps (byte ranges) that allocate() zeroes, worked out once per layout.
        ends = [s.offset + s.nbytes for s in self.segments]
        starts = [s.offset for s in self.segments[1:]] + [self.nbytes]
        self._padding: Tuple[Tuple[int, int], ...] = tuple((end, start) for end, start in zip(ends, starts)
                                                           if start > end)

    def allocate(self, device) -> "Payload":
        """A payload with an uninitialised buffer on ``device``."""
        buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        # Zero the alignment padding: the bytes on the wire are then a function of the
        # data alone (deterministic, and no stale memory is sent to other ranks).
        for end, start in self._padding:
            buffer[end:start].zero_()
        return Payload(self, buffer)

    def __eq__(self, other) -> bool:
        return isinstance(other, PayloadLayout) and self.segments == other.segments

    def __hash__(self) -> int:
        return hash(self.segments)

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}:{s.dtype}[{s.numel}]@{s.offset}" for s in self.segments)
        return f"PayloadLayout({parts}; {self.nbytes} bytes)"


class Payload:
    """A payload: ``buffer`` is a 1-D uint8 tensor of ``layout.nbytes`` bytes.

    ``payload[name]`` is a typed 1-D view of one segment; writing to it writes the buffer.
    """

    def __init__(self, layout: PayloadLayout, buffer: torch.Tensor):
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != layout.nbytes:
            raise ValueError(
                f"payload buffer must be a 1-D uint8 tensor of {layout.nbytes} bytes, "
                f"got {buffer.dtype} of shape {tuple(buffer.shape)}"
            )
        self.layout = layout
        self.buffer = buffer
        self._views: Dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self._views.get(name)
        if view is None:
            for segment in self.layout.segments:
                if segment.name == name:
                    raw = self.buffer[segment.offset : segment.offset + segment.nbytes]
                    view = raw.view(segment.dtype)
                    break
            else:
                raise KeyError(f"payload has no segment {name!r}; it has {[s.name for s in self.layout.segments]}")
            self._views[name] = view
        return view

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes
