"""Top-k's batched form over a group's parts (``kernel_parts("topk_compress")``, :mod:`gradcomp.backends.parts`).

The contract: one call selects every part's top-k bitwise as the per-part op does on the part alone (values, the
part's own indices, the residual), whatever the backend; a part that does not fit is refused before anything is
written. The numba form runs the one-chunk parts in one serial call and larger parts by the parallel kernel.
"""
import pytest
import torch

import gradcomp
import gradcomp.backends
from gradcomp.backends import kernel, kernel_parts
from gradcomp.backends.parts import Selection
from gradcomp.compressors.per_parameter import PerParameter

pytest.importorskip("numba", reason="the batched form under test is numba's")

# One-chunk parts (a scalar, sizes not multiples of 8) and two of several 65536-element chunks.
NUMELS = (3000, 1, 140_001, 517, 65_536, 131_072, 9)


def selections(numels, density):
    rows, lo, first = [], 0, 0
    for n in numels:
        k = min(n, max(1, int(density * n + 0.999)))
        rows.append(Selection(lo, n, first, k))
        lo, first = lo + n, first + k
    return tuple(rows)


def data(n, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=generator) * torch.rand(n, generator=generator) * 3
    grad[::97] = 0.5  # ties at every level of the radix select
    for at, special in ((5, float("inf")), (4000, float("nan")), (200_000, -float("inf"))):
        if at < n:
            grad[at] = special
    return grad.to(dtype), torch.randn(n, generator=generator) * 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("residuals", ["none", "in-place", "separate"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_the_batched_selection_is_each_part_selected_alone(dtype, residuals, index_dtype):
    n, rows = sum(NUMELS), selections(NUMELS, 0.02)
    total = sum(row.k for row in rows)
    grad, residual = data(n, dtype, seed=3)
    results = {}
    for backend in ("numba", "torch"):
        res_in = None if residuals == "none" else residual.clone()
        res_out = {"none": None, "in-place": res_in, "separate": torch.full((n,), float("nan"))}[residuals]
        values, indices = torch.full((total,), 7.0, dtype=dtype), torch.full((total,), -1, dtype=index_dtype)
        kernel_parts("topk_compress", "cpu", backend)(grad, res_in, res_out, values, indices, rows)
        results[backend] = (values, indices, res_out)
    alone = kernel("topk_compress", "cpu", "numba")
    for row in rows:
        piece, entries = slice(row.lo, row.lo + row.numel), slice(row.first, row.first + row.k)
        values, indices = torch.empty(row.k, dtype=dtype), torch.empty(row.k, dtype=index_dtype)
        res_out = None if residuals == "none" else torch.full((row.numel,), float("nan"))
        alone(grad[piece], None if residuals == "none" else residual[piece], res_out, values, indices)
        for backend, (got_values, got_indices, got_residual) in results.items():
            assert torch.equal(got_indices[entries], indices), (backend, row)
            torch.testing.assert_close(got_values[entries], values, rtol=0, atol=0, equal_nan=True)
            if res_out is not None:
                torch.testing.assert_close(got_residual[piece], res_out, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bad", [Selection(0, 10, 0, 0), Selection(0, 10, 0, 11), Selection(95, 10, 0, 1),
                                 Selection(0, 10, 30, 1), Selection(-1, 10, 0, 1), Selection(0, 0, 0, 1)])
def test_a_part_that_does_not_fit_is_refused_and_nothing_is_written(bad):
    grad, residual = data(100, torch.float32, seed=1)
    rows = (Selection(0, 50, 0, 5), bad)
    for backend in ("numba", "torch"):
        values, indices, res_out = torch.zeros(30), torch.zeros(30, dtype=torch.int32), torch.zeros(100)
        with pytest.raises(ValueError, match="does not fit"):
            kernel_parts("topk_compress", "cpu", backend)(grad, residual, res_out, values, indices, rows)
        assert not values.any() and not indices.any() and not res_out.any()


def test_compact_top_k_groups_select_in_one_call(monkeypatch):
    """The recipe's compact per-parameter top-k runs its selection through the batched form, once a compress."""
    key = ("topk_compress/parts", "numba")
    calls = []
    batched = gradcomp.backends.KERNELS[key]
    monkeypatch.setitem(gradcomp.backends.KERNELS, key, lambda *args: calls.append(1) or batched(*args))
    grouped = PerParameter(gradcomp.TopK(0.02, entries="compact"), NUMELS, dense_below=1024)
    grad, residual = data(sum(NUMELS), torch.float32, seed=2)
    grouped.compress(grad, residual, torch.empty_like(residual), backend="numba")
    assert calls == [1]
