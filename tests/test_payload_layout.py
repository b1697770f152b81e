"""Payload layouts: segment sizes, zeroed alignment padding, and no allocation but the buffer's.

A layout is read on every compress of every parameter, so reading it must cost no tensor
allocation (a scratch tensor per ``Segment.nbytes`` once was a measurable share of a small
model's step).
"""
from __future__ import annotations

import pytest
import torch

from gradcomp.payload import PayloadLayout

SPECS = (("values", torch.bfloat16, 5), ("indices", torch.int32, 3), ("codes", torch.int64, 1),
         ("scales", torch.float32, 7), ("bytes", torch.uint8, 2))


def test_segments_are_sized_by_their_dtype_and_aligned():
    layout = PayloadLayout(SPECS)
    for segment, (_, dtype, numel) in zip(layout.segments, SPECS):
        assert segment.nbytes == numel * torch.empty((), dtype=dtype).element_size()
        assert segment.offset % 8 == 0
    # 10 bytes at 0, 12 at 16, 8 at 32, 28 at 40, 2 at 72: 80 bytes, 20 of them padding.
    assert [s.offset for s in layout.segments] == [0, 16, 32, 40, 72]
    assert layout.nbytes == 80

def test_allocate_zeroes_the_padding_and_allocates_only_the_buffer(monkeypatch):
    layout = PayloadLayout(SPECS)
    calls = []
    real_empty = torch.empty

    def counting_empty(*args, **kwargs):
        calls.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", counting_empty)
    payload = layout.allocate("cpu")
    assert sum(s.nbytes for s in layout.segments) == 60 and payload.nbytes == 80
    assert len(calls) == 1, "a layout read must not allocate scratch tensors"
    covered = torch.zeros(layout.nbytes, dtype=torch.bool)
    for segment in layout.segments:
        covered[segment.offset: segment.offset + segment.nbytes] = True
    assert not payload.buffer[~covered].any()
    assert int((~covered).sum()) == 20


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.int64])
def test_segment_nbytes_matches_the_view(dtype):
    payload = PayloadLayout((("x", dtype, 13),)).allocate("cpu")
    assert payload["x"].numel() == 13 and payload["x"].dtype == dtype
