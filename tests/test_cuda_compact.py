"""The CUDA forms of compact top-k's encode and check over a group's parts (``csrc/compact.cu``, launched by
``gradcomp/backends/cuda_compact.py``), run in the CPU emulation against the torch forms of
:class:`~gradcomp.backends.sparse_parts.CompactParts`: the same payload bytes and residuals, the same verdict on
every corrupted payload, the same entries on every accepted one, and no write outside the payload.
"""
import types

import pytest
import torch

import gradcomp
from gradcomp.backends.cuda_launch import LaunchConfig
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.payload import Payload
from test_cuda_kernels import TINY, Guarded, build_emulator, cuda_ops

# Parts of several 65536-element chunks, a part's last chunk short, and parts sent dense between them.
NUMELS = (70_000, 3000, 65_536, 10, 140_001)
DENSE_BELOW = 1024
#: One thread in one block: every grid-stride loop runs the whole range in one thread.
SERIAL = LaunchConfig(threads=1, max_blocks=1, histogram_blocks=1)


@pytest.fixture(scope="module")
def emulator():
    return build_emulator()


@pytest.fixture(scope="module")
def group():
    """``(grouped compressor, its CompactParts, int32 indices, float32 values)``: each compressed part's
    ``k`` distinct ascending own positions, values at bfloat16's rounding edges first (ties to even, the
    largest finite, infinities, subnormals, signed zeros, a NaN), then normal noise."""
    grouped = PerParameter(gradcomp.TopK(0.02, entries="compact"), NUMELS, dense_below=DENSE_BELOW)
    parts = grouped._plan(torch.float32).sparse["cpu"]
    kept = [part for part in grouped.parts if not part.dense]
    generator = torch.Generator().manual_seed(3)
    indices = torch.cat([torch.randperm(part.numel, generator=generator)[:grouped.base.k(part.numel)].sort().values
                         for part in kept]).to(torch.int32)
    edges = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38, 3.4e38, float("inf"),
                          -float("inf"), 1e-40, -1e-45, 0.0, -0.0, float("nan")])
    values = torch.randn(indices.numel(), generator=generator)
    values[:edges.numel()] = edges
    return grouped, parts, indices, values


def guarded_payload(grouped) -> Guarded:
    """A zeroed payload (``.tensor.view(torch.uint8)``) inside a buffer whose margins hold a sentinel (int64
    words keep the payload 8-byte aligned, as its segments' views need)."""
    words = grouped._plan(torch.float32).whole.nbytes // 8
    return Guarded(words, torch.int64, fill=torch.zeros(words, dtype=torch.int64))


@pytest.mark.parametrize("config", [TINY, SERIAL], ids=["tiny", "serial"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_emulated_cuda_compact_encode_writes_the_torch_forms_bits(emulator, group, config, with_residual):
    grouped, parts, indices, values = group
    residual = torch.randn(sum(NUMELS), generator=torch.Generator().manual_seed(4)) if with_residual else None
    expected_bytes = guarded_payload(grouped).tensor.view(torch.uint8)
    expected_residual = None if residual is None else residual.clone()
    parts.encode(values, indices, expected_bytes, expected_residual, "torch")
    guarded = guarded_payload(grouped)
    payload = guarded.tensor.view(torch.uint8)
    out = None if residual is None else residual.clone()
    assert cuda_ops.plan_compact_encode(emulator, config, parts, values, indices, payload, out)
    guarded.check("compact encode")
    # A NaN value's bfloat16 bits are left open by the top-k contract; every other byte is the torch form's.
    nan_slot = int(parts.values[0]) + int(torch.isnan(values).nonzero()[0, 0])
    halves, expected_halves = payload.view(torch.int16).clone(), expected_bytes.view(torch.int16).clone()
    assert bool(torch.isnan(halves[nan_slot:nan_slot + 1].view(torch.bfloat16)).all())
    halves[nan_slot] = expected_halves[nan_slot] = 0
    assert torch.equal(halves, expected_halves)
    if residual is not None:  # an infinity or NaN sent leaves a NaN residual: the same entries on both
        torch.testing.assert_close(out, expected_residual, rtol=0, atol=0, equal_nan=True)
        assert not torch.equal(out, residual)
    assert not cuda_ops.plan_compact_encode(emulator, config, parts, values.double(), indices, payload, out)


def _corruptions(grouped, payload):
    """``(what, corrupted payload bytes)``: counts moved between a part's chunks (its total kept), lowered,
    made negative; 16-bit indices set at or past a short chunk's end, onto a neighbour's, to the edges of 16 bits."""
    generator = torch.Generator().manual_seed(1)
    def parts_of(buffer):
        return grouped.parts_of(Payload(grouped._plan(torch.float32).whole, buffer))

    for number, (part, own) in enumerate(parts_of(payload)):
        if part.dense:
            continue
        for chunk in range(own["counts"].numel()):
            for moved, total_kept in (((chunk, chunk + 1), True), ((chunk + 1, chunk), True), ((chunk, None), False)):
                if max(c for c in moved if c is not None) >= own["counts"].numel():
                    continue
                bad = payload.clone()
                counts = parts_of(bad)[number][1]["counts"]
                counts[moved[0]] -= 1
                if total_kept:
                    counts[moved[1]] += 1
                yield f"part {number} count {moved}", bad
                if total_kept:  # a negative count, the part's total kept
                    counts[moved[1]] += int(counts[moved[0]]) + 1
                    counts[moved[0]] = -1
                    yield f"part {number} negative count {moved}", bad
        local = own["local"]
        limit = part.numel - (own["counts"].numel() - 1) * 65536  # the last chunk's elements: its last index's bound
        last = local.numel() - 1
        for slot, value in ((last, limit), (last, limit - 1)):  # (a 16-bit index one past a short chunk's end)
            if limit < 65536:
                bad = payload.clone()
                parts_of(bad)[number][1]["local"][slot] = value - ((value & 0x8000) << 1)
                yield f"part {number} last index {value} of a {limit}-element chunk", bad
        for slot in torch.randperm(local.numel(), generator=generator)[:8].tolist() + [0, last]:
            for value in (-1, 0, 32767, -32768, int(local[slot]) + 1, int(local[slot - 1])):
                bad = payload.clone()
                parts_of(bad)[number][1]["local"][slot] = value
                yield f"part {number} index {slot} = {value}", bad


def test_emulated_cuda_compact_check_judges_as_the_torch_form(emulator, group):
    """The torch form's verdict on every corruption, and its entries (group positions, bfloat16 bits) on every
    payload it accepts; the payload is only read."""
    grouped, parts, indices, values = group
    payload = guarded_payload(grouped).tensor.view(torch.uint8)
    parts.encode(values, indices, payload, None, "torch")
    rejected = accepted = 0
    for what, bad in [("valid", payload)] + list(_corruptions(grouped, payload)):
        expected = parts.entries(bad, torch.float32, "torch")
        before = bad.clone()
        for config in (TINY, SERIAL):
            found = cuda_ops.plan_compact_entries(emulator, config, parts, bad)
            assert torch.equal(bad, before), f"{what}: the check wrote into the payload"
            assert (found is None) == (expected is None), f"{what}: verdict {found is None} != {expected is None}"
            if found is not None:
                assert torch.equal(found[0], expected[0]), what
                assert torch.equal(found[1].view(torch.int16), expected[1].view(torch.int16)), what
        rejected, accepted = rejected + (expected is None), accepted + (expected is not None)
    assert rejected > 40 and accepted > 10


def test_emulated_cuda_compact_forms_round_trip_through_the_group(emulator, group):
    """The group's compress with the CUDA encode, then its check and decode with the CUDA check: the torch
    forms' payload, residual and average, bitwise."""
    grouped, parts, _, _ = group
    generator = torch.Generator().manual_seed(9)
    grad, residual = torch.randn(sum(NUMELS), generator=generator), torch.randn(sum(NUMELS), generator=generator)
    results = []
    for form in ("torch", "emulated"):
        plan = grouped._plan(torch.float32)
        if form == "emulated":  # the plan's CompactParts stand-in: only its encode and entries are called
            plan.sparse["cpu"] = types.SimpleNamespace(
                encode=lambda values, indices, buffer, out, backend=None: cuda_ops.plan_compact_encode(
                    emulator, TINY, parts, values, indices, buffer, out),
                entries=lambda buffer, dtype=None, backend=None: cuda_ops.plan_compact_entries(
                    emulator, TINY, parts, buffer))
        try:
            out = torch.empty(sum(NUMELS))
            payload = grouped.compress(grad, residual, out, backend="torch")
            average = torch.zeros(sum(NUMELS))
            grouped.add_checked(payload, grouped.check_payload(payload, sum(NUMELS)), average, "torch")
            results.append((payload.buffer.clone(), out, average))
        finally:
            plan.sparse["cpu"] = parts
    for got, expected, what in zip(results[1], results[0], ("payload", "residual", "average")):
        assert torch.equal(got, expected), what

