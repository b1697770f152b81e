"""Compressors against plain references: top-k sets, the MXNet 2-bit rule, the
error-feedback identity, payload sizes, argument validation."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcomp
from gradcomp.backends import torch_ops
from gradcomp.validation import PayloadError, validate_payload

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def finite_vectors(min_size=1, max_size=300):
    floats = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)
    return st.lists(floats, min_size=min_size, max_size=max_size).map(lambda v: torch.tensor(v, dtype=torch.float32))


def roundtrip(compressor, grad, residual=None):
    residual_out = torch.empty(grad.numel(), dtype=torch.float32)
    payload = compressor.compress(grad, residual, residual_out, backend="torch")
    decoded = torch.zeros(grad.numel(), dtype=torch.float32)
    compressor.decompress_add(payload, decoded, backend="torch")
    return payload, decoded, residual_out


# -- top-k ------------------------------------------------------------------------------
@pytest.mark.parametrize("n,ratio", [(1, 0.01), (10, 0.01), (1000, 0.01), (1000, 0.1), (4097, 0.003), (64, 1.0)])
def test_topk_selects_the_same_set_as_torch_topk(n, ratio):
    torch.manual_seed(n)
    grad = torch.randn(n)
    compressor = gradcomp.TopK(ratio)
    k = max(1, math.ceil(ratio * n))
    payload, decoded, _ = roundtrip(compressor, grad)
    expected = set(torch.topk(grad.abs(), k).indices.tolist())
    assert set(payload["indices"].tolist()) == expected
    assert payload["indices"].tolist() == sorted(expected)
    assert torch.equal(payload["values"], grad[payload["indices"].long()])
    assert torch.count_nonzero(decoded) == k


def test_topk_ties_resolve_to_lower_indices_and_match_torch_up_to_ties():
    grad = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 0.5])
    payload, _, _ = roundtrip(gradcomp.TopK(0.5), grad)  # k = 3 of the three |3| entries
    assert payload["indices"].tolist() == [1, 2, 4]
    payload, _, _ = roundtrip(gradcomp.TopK(0.34), grad)  # k = 3 as well
    ties = torch.full((40,), 2.0)
    payload, _, _ = roundtrip(gradcomp.TopK(0.1), ties)
    assert payload["indices"].tolist() == [0, 1, 2, 3]
    # Same magnitudes as torch.topk's choice, whichever tied entries it took.
    top_torch = torch.topk(ties.abs(), 4).values
    assert torch.equal(payload["values"].abs().sort().values, top_torch.sort().values)


@given(finite_vectors(), st.floats(0.001, 1.0))
@settings(max_examples=150, deadline=None)
def test_topk_magnitudes_equal_torch_topk_and_ef_identity_is_exact(acc, ratio):
    compressor = gradcomp.TopK(ratio)
    k = compressor.k(acc.numel())
    payload, decoded, residual = roundtrip(compressor, acc)
    selected = payload["values"].abs().sort().values
    assert torch.equal(selected, torch.topk(acc.abs(), k).values.sort().values)
    assert torch.equal(decoded + residual, acc)  # acc == D(C(acc)) + e', exactly


def test_topk_is_deterministic():
    grad = torch.randn(10_000)
    first, _, r1 = roundtrip(gradcomp.TopK(0.01), grad)
    second, _, r2 = roundtrip(gradcomp.TopK(0.01), grad)
    assert torch.equal(first.buffer, second.buffer) and torch.equal(r1, r2)


def test_topk_index_width_follows_numel():
    assert gradcomp.TopK.index_dtype(2**31 - 1) == torch.int32
    assert gradcomp.TopK.index_dtype(2**31) == torch.int64
    layout = gradcomp.TopK(0.001).layout(2**31, torch.float16)
    values, indices = layout.segments
    assert values.numel == indices.numel == math.ceil(0.001 * 2**31)
    assert indices.dtype == torch.int64 and indices.offset % 8 == 0


# -- 2-bit ----------------------------------------------------------------------------------
def mxnet_twobit(acc, t):
    """MXNet's rule written out element by element."""
    sent, residual = [], []
    for a in acc.tolist():
        if a >= t:
            sent.append(t), residual.append(a - t)
        elif a <= -t:
            sent.append(-t), residual.append(a + t)
        else:
            sent.append(0.0), residual.append(a)
    return torch.tensor(sent, dtype=torch.float32), torch.tensor(residual, dtype=torch.float32)


@given(finite_vectors(), st.sampled_from([0.5, 0.25, 1.0, 3.0]))
@settings(max_examples=150, deadline=None)
def test_twobit_follows_the_mxnet_rule_element_by_element(acc, t):
    _, decoded, residual = roundtrip(gradcomp.TwoBit(t), acc)
    sent, expected_residual = mxnet_twobit(acc, t)
    assert torch.equal(decoded, sent)
    assert torch.equal(residual, acc - decoded)
    assert torch.allclose(residual, expected_residual, rtol=0, atol=1e-6 * (1 + acc.abs().max().item()))


@given(st.lists(st.integers(-64, 64), min_size=1, max_size=200), st.sampled_from([0.5, 0.25]))
@settings(max_examples=100, deadline=None)
def test_twobit_error_feedback_identity_is_exact_on_dyadic_values(values, t):
    acc = torch.tensor(values, dtype=torch.float32) / 32  # exactly representable sums
    _, decoded, residual = roundtrip(gradcomp.TwoBit(t), acc)
    assert torch.equal(decoded + residual, acc)


def test_twobit_packs_16_codes_per_word_with_the_documented_layout():
    t = 0.5
    acc = torch.zeros(33)
    acc[0], acc[1], acc[15], acc[16], acc[32] = 0.7, -0.5, -2.0, float("nan"), 0.5
    payload, decoded, _ = roundtrip(gradcomp.TwoBit(t), acc)
    codes = payload["codes"]
    assert codes.dtype == torch.int32 and codes.numel() == 3
    word0 = codes[0].item() & 0xFFFFFFFF
    assert word0 == 0b01 | (0b10 << 2) | (0b10 << 30)
    assert codes[1].item() == 0b11 and codes[2].item() == 0b01
    assert decoded[0] == t and decoded[1] == -t and decoded[15] == -t and decoded[32] == t
    assert math.isnan(decoded[16].item())
    assert payload.nbytes == 16  # 12 bytes of codes, padded to 8


def test_twobit_residual_with_feedback_in_low_precision():
    grad = torch.tensor([0.3, 0.3, -0.9, 0.1], dtype=torch.bfloat16)
    residual = torch.tensor([0.3, 0.0, 0.0, 0.0])
    _, decoded, residual_out = roundtrip(gradcomp.TwoBit(0.5), grad, residual)
    acc = grad.float() + residual
    assert residual_out.dtype == torch.float32
    assert torch.equal(decoded, torch.tensor([0.5, 0.0, -0.5, 0.0]))
    assert torch.equal(residual_out, acc - decoded)


# -- all compressors --------------------------------------------------------------------------
ALL = [gradcomp.TopK(0.05), gradcomp.TopK(0.05, entries="compact"), gradcomp.TwoBit(0.5), gradcomp.TwoBit("chunk"),
       gradcomp.ThreeBit(), gradcomp.Identity(), gradcomp.FP16(), gradcomp.BF16()]


@pytest.mark.parametrize("compressor", ALL, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_payload_size_depends_only_on_numel_and_dtype(compressor, dtype):
    sizes = {
        compressor.compress(torch.randn(777).to(dtype) * scale, backend="torch").nbytes for scale in (0, 1e-3, 1e3)
    }
    assert sizes == {compressor.layout(777, dtype).nbytes}
    assert compressor.layout(777, dtype).nbytes % 8 == 0


@pytest.mark.parametrize("compressor", ALL, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_identity_with_a_residual(compressor, dtype):
    torch.manual_seed(1)
    grad = (torch.randn(513) / 4).to(dtype)
    residual = torch.randn(513) / 64
    _, decoded, residual_out = roundtrip(compressor, grad, residual)
    acc = grad.float() + residual
    assert torch.equal(residual_out, acc - decoded)
    assert torch.allclose(decoded + residual_out, acc, rtol=0, atol=1e-6)


@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_in_place_residual_update_equals_out_of_place(compressor):
    grad, residual = torch.randn(300), torch.randn(300)
    expected = torch.empty(300)
    first = compressor.compress(grad, residual, expected, backend="torch")
    aliased = residual.clone()
    second = compressor.compress(grad, aliased, aliased, backend="torch")
    assert torch.equal(first.buffer, second.buffer) and torch.equal(aliased, expected)


@pytest.mark.parametrize("compressor", ALL, ids=repr)
def test_decompress_into_low_precision_output(compressor):
    grad = torch.randn(100).to(torch.float16)
    payload = compressor.compress(grad, backend="torch")
    out = torch.empty(100, dtype=torch.float16)
    staging = torch.zeros(100)
    compressor.decompress_add(payload, staging, backend="torch")
    assert torch.equal(compressor.decompress(payload, out, backend="torch"), staging.half())


@pytest.mark.parametrize("compressor", [gradcomp.Identity(), gradcomp.FP16(), gradcomp.BF16()], ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_cast_decompresses_to_what_one_summed_payload_gives_keeping_a_zeros_sign(compressor, dtype):
    grad = torch.cat([torch.randn(200) * 1e3, torch.tensor([0.0, -0.0, 6e-8, -6e-8, 1e-30])]).to(dtype)
    payload = compressor.compress(grad, backend="torch")
    summed = torch.zeros(205)
    compressor.decompress_add(payload, summed, backend="torch")
    out = torch.full((205,), float("nan"))
    assert compressor.decompress(payload, out, backend="torch") is out
    assert torch.equal(out, summed)  # every value (equal treats -0.0 as 0.0)
    assert torch.equal(out.signbit(), payload["data"].float().signbit())  # one conversion: a -0.0 stays -0.0


# -- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("density", [0, -0.1, 1.5, float("nan"), float("inf")])
def test_topk_rejects_density_outside_range(density):
    with pytest.raises(ValueError, match=r"density.*\(0, 1\]"):
        gradcomp.TopK(density)


@pytest.mark.parametrize("density", ["0.1", None, True])
def test_topk_rejects_non_numbers(density):
    with pytest.raises(TypeError, match="density"):
        gradcomp.TopK(density)


@pytest.mark.parametrize("threshold", [0, -1.0, float("nan"), float("inf"), 1e-50])
def test_twobit_rejects_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold"):
        gradcomp.TwoBit(threshold)


@pytest.mark.parametrize("compressor", ALL, ids=repr)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64, torch.bool])
def test_non_floating_gradients_are_rejected(compressor, dtype):
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        compressor.compress(torch.zeros(10, dtype=dtype))


def test_non_flat_gradients_are_rejected():
    with pytest.raises(ValueError, match="flat"):
        gradcomp.TopK(0.1).compress(torch.zeros(4, 4))


def test_reference_topk_select_orders_nan_above_inf_above_finite():
    acc = torch.tensor([1.0, float("inf"), -5.0, float("nan"), -float("inf")])
    assert torch_ops.topk_select(acc, 3).tolist() == [1, 3, 4]




# -- top-k's compact entries ------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 700, 65536, 65537, 200_003])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compact_topk_sends_the_wide_selection_at_half_the_bytes(n, dtype):
    """The same entries as the wide payload, each value rounded to bfloat16, at 4 bytes an entry
    (and a count per chunk of 65,536) where the wide float32 payload spends 8."""
    torch.manual_seed(n)
    grad, residual = (torch.randn(n) * 3).to(dtype), torch.randn(n) / 8
    wide, compact = gradcomp.TopK(0.05), gradcomp.TopK(0.05, entries="compact")
    wide_payload, compact_payload = wide.compress(grad, residual, backend="torch"), compact.compress(grad, residual,
                                                                                                   backend="torch")
    assert torch.equal(compact.sent_indices(compact_payload), wide_payload["indices"].long())
    assert torch.equal(compact_payload["values"], wide_payload["values"].to(torch.bfloat16))
    k, chunks = wide.k(n), -(-n // 65536)
    assert compact.layout(n, dtype).nbytes <= 4 * k + 4 * chunks + 16
    if dtype == torch.float32 and k >= 64:
        assert compact.layout(n, dtype).nbytes < 0.55 * wide.layout(n, dtype).nbytes


def _compact_payload(n=140_000, density=0.01):
    compressor = gradcomp.TopK(density, entries="compact")
    return compressor, compressor.compress(torch.randn(n), backend="torch"), n


@pytest.mark.parametrize("forge", ["negative count", "counts short", "counts long", "local backwards",
                                   "entry past the end"])
def test_compact_topk_rejects_forged_counts_and_indices(forge):
    compressor, payload, n = _compact_payload()
    counts, local = payload["counts"], payload["local"]
    if forge == "negative count":  # the counts still add up to k
        counts[1] += int(counts[0]) + 1
        counts[0] = -1
    elif forge == "counts short":
        counts[0] -= 1
    elif forge == "counts long":
        counts[-1] += 1
    elif forge == "local backwards":
        local[1], local[2] = int(local[2]), int(local[1])
    else:  # the last chunk holds n - 2 * 65536 elements: its count moved there points past them
        counts[-1] += int(counts[0])
        counts[0] = 0
    with pytest.raises(PayloadError):
        validate_payload(compressor, payload, n, rank=1)
    with pytest.raises(ValueError):
        compressor.decompress_add(payload, torch.zeros(n), backend="torch")


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_compact_topk_fused_forms_are_the_entrywise_ones_bitwise(backend):
    """A whole group's compact payload goes through a one-part CompactParts (the per-parameter groups' fused
    encode, check and decode): bitwise what compact_encode and the top-k decode kernel give entry by entry."""
    from gradcomp.backends import kernel
    from gradcomp.compressors.topk import compact_encode

    torch.manual_seed(3)
    n = 140_003
    compressor = gradcomp.TopK(0.01, entries="compact")
    grad, residual = torch.randn(n), torch.randn(n) / 8
    fused_residual, entrywise_residual = torch.zeros(n), torch.zeros(n)
    payload = compressor.compress(grad, residual, fused_residual, backend=backend)
    k = compressor.k(n)
    values, indices = torch.empty(k), torch.empty(k, dtype=torch.int32)
    kernel("topk_compress", grad.device, backend)(grad, residual, entrywise_residual, values, indices)
    entrywise = compressor.layout(n, torch.float32).allocate(grad.device)
    compact_encode(values, indices, entrywise, entrywise_residual, compressor.CHUNK)
    assert torch.equal(payload.buffer, entrywise.buffer)
    assert torch.equal(fused_residual, entrywise_residual)
    start = torch.randn(n)
    decoded, checked, by_kernel = start.clone(), start.clone(), start.clone()
    compressor.decompress_add(payload, decoded, backend=backend)
    compressor.add_checked(payload, compressor.check_payload(payload, n), checked)
    kernel("topk_decompress_add", grad.device, backend)(payload["values"], compressor.sent_indices(payload), by_kernel)
    assert torch.equal(decoded, by_kernel) and torch.equal(checked, by_kernel)
    assert not torch.equal(by_kernel, start)


@pytest.mark.parametrize("entries", ["wide", "compact"])
def test_topk_copied_with_another_density_lays_out_its_own_entries(entries):
    """A schedule copies a TopK (copy.copy) and sets another density: the copy's layout and compact plan are
    its own, not the ones the original built and keeps (they share the dicts that hold them)."""
    import copy

    n, grad = 70_000, torch.randn(70_000)
    first = gradcomp.TopK(0.25, entries=entries)
    first.check_payload(first.compress(grad), n)
    second = copy.copy(first)
    second.density = 0.01
    assert second.layout(n, torch.float32) == gradcomp.TopK(0.01, entries=entries).layout(n, torch.float32)
    payload, out = second.compress(grad), torch.zeros(n)
    second.check_payload(payload, n)
    second.decompress_add(payload, out)
    assert int((out != 0).sum()) == second.k(n)
    assert first.layout(n, torch.float32).nbytes > 10 * payload.layout.nbytes


def test_compact_topk_decode_refuses_a_payload_laid_out_for_another_size():
    """The fused decode reads the buffer at the offsets of ``out``'s size: a payload of another size is refused
    before any byte is read, as the entry-wise kernel's checks refused it."""
    compressor = gradcomp.TopK(0.01, entries="compact")
    payload = compressor.compress(torch.randn(70_000))  # shorter than a [140_000] payload: the plan would read past it
    out = torch.zeros(140_000)
    with pytest.raises(ValueError):
        compressor.decompress_add(payload, out)
    assert not out.any()
