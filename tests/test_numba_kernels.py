"""The Numba CPU kernels against the torch reference, bit for bit.

Every op runs on both backends with the same inputs; codes, indices, values (including
NaN bit patterns), residuals and decoded sums must be identical. Sizes cover one
element, partial 16-element code words, several 8192-element scratch blocks and, with
the chunk size patched down, many top-k chunks.

NaN payloads are compared too, with two exceptions that come from the reference, not from
the contract:

* where both operands of an addition are NaN, which payload survives depends on the
  operand order the compiler picks, so no input puts NaN on both sides of an add
  (gradient and residual, or decoded value and ``out``);
* torch's own float16 to float32 conversion writes NaN as ``0x7FFFFFFF`` in the tail of
  its vector loop and keeps sign and payload elsewhere, so for float16 gradients any NaN
  matches any NaN.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

numba = pytest.importorskip("numba")

from gradcomp.backends import KERNELS, OPS, is_available, torch_ops  # noqa: E402,F401  (torch_ops registers)
from gradcomp.backends.numba import ops as numba_ops  # noqa: E402,F401  (registers the numba ops)
from gradcomp.backends.numba import topk as numba_topk  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
THRESHOLD = 0.5
_INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64}


def bits(tensor):
    """The raw bits of a tensor, so that comparisons see NaN payloads and -0.0."""
    return tensor.view(_INT_VIEW[tensor.element_size()]) if tensor.dtype.is_floating_point else tensor


def assert_same_bits(actual, expected, what, nan_equal=False):
    assert actual.dtype == expected.dtype, what
    differ = bits(actual) != bits(expected)
    if nan_equal and actual.dtype.is_floating_point:
        differ &= ~(torch.isnan(actual) & torch.isnan(expected))
    mismatch = differ.nonzero()
    first = mismatch[:5].flatten().tolist()
    assert mismatch.numel() == 0, f"{what}: {mismatch.numel()} elements differ, first at {first}"


def gaussian(n, seed, scale=1.0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def with_specials(values, seed, threshold=THRESHOLD):
    """Scatter NaN, +-inf, +-0.0, subnormals (of every format), huge values, exact
    thresholds and repeated values (ties) over a float32 vector."""
    values = values.clone()
    n = values.numel()
    specials = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-41, -3e-45, 1e-39, 3e-6, -6e-8,
                3e38, -7e4, 65504.0, threshold, -threshold, 1.5, 1.5, 1.5, -1.5, 1.5]
    positions = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: min(n, len(specials))]
    values[positions] = torch.tensor(specials[: positions.numel()])
    return values


def make_grad(n, dtype, seed, specials):
    values = gaussian(n, seed)
    return (with_specials(values, seed + 1) if specials else values).to(dtype)


def make_residual(grad, seed, specials):
    """A residual with -0.0 and +-inf where the gradient is finite, never NaN on NaN."""
    residual = gaussian(grad.numel(), seed, 0.3)
    if specials and grad.numel() > 2:
        finite = torch.isfinite(grad.float()).nonzero().flatten()
        residual[finite[:1]] = -0.0
        residual[finite[1:2]] = float("inf")
    return residual


RESIDUAL_MODES = ["none", "separate", "inplace", "not_written"]


def residuals(mode, grad, seed, specials):
    """``(residual_in, residual_out)`` per mode; ``residual_out`` starts as garbage."""
    if mode == "none":
        return None, torch.full((grad.numel(),), 7.0)
    residual_in = make_residual(grad, seed, specials)
    if mode == "separate":
        return residual_in, torch.full((grad.numel(),), 7.0)
    if mode == "inplace":
        return residual_in, residual_in
    return residual_in, None


def run_both(op, make_args):
    """Run ``op`` on both backends with fresh copies of the same arguments; return both
    argument tuples after the call (the outputs are among them)."""
    results = {}
    for backend in ("torch", "numba"):
        args = make_args()
        KERNELS[(op, backend)](*args)
        results[backend] = args
    return results["numba"], results["torch"]


def clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def compress_args(grad, residual_in, residual_out, *outputs):
    """Fresh copies of the arguments, keeping ``residual_out is residual_in`` in place."""
    rin = clone(residual_in)
    rout = rin if residual_out is residual_in else clone(residual_out)
    return (grad.clone(), rin, rout, *(clone(o) for o in outputs))


# ----------------------------------------------------------------------------------------
# Registration.
# ----------------------------------------------------------------------------------------


def test_numba_backend_registers_every_op():
    assert is_available("numba", "cpu")
    assert not is_available("numba", "meta")
    for op in OPS:
        assert (op, "numba") in KERNELS, op


# ----------------------------------------------------------------------------------------
# 2-bit.
# ----------------------------------------------------------------------------------------


def check_twobit(grad, residual_in, residual_out, threshold=THRESHOLD, seed=0):
    n = grad.numel()
    nan_equal = grad.dtype == torch.float16  # see the module docstring
    codes = torch.full(((n + 15) // 16,), -1, dtype=torch.int32)
    got, want = run_both(
        "twobit_compress", lambda: (*compress_args(grad, residual_in, residual_out), threshold, codes.clone())
    )
    assert_same_bits(got[4], want[4], "codes")
    if residual_out is not None:
        assert_same_bits(got[2], want[2], "residual_out", nan_equal)
    if residual_in is not None and residual_out is not residual_in:
        assert_same_bits(got[1], want[1], "residual_in must not change")
    out = gaussian(n, seed + 7)
    out[: min(n, 3)] = -0.0  # -0.0 + 0.0 must come out +0.0, as in torch
    got_out, want_out = run_both("twobit_decompress_add", lambda: (want[4].clone(), threshold, out.clone()))
    assert_same_bits(got_out[2], want_out[2], "decoded sum")


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 1000, 3 * 8192 + 17, 100_003])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", RESIDUAL_MODES)
def test_twobit_matches_reference(n, dtype, mode):
    grad = make_grad(n, dtype, seed=n, specials=True)
    residual_in, residual_out = residuals(mode, grad, seed=n + 1, specials=True)
    check_twobit(grad, residual_in, residual_out, seed=n)


@pytest.mark.parametrize("threshold", [1e-30, 1e-3, 1.0, 3e38])
def test_twobit_thresholds(threshold):
    grad = make_grad(4099, torch.float32, seed=3, specials=True) * 10
    residual_in, residual_out = residuals("separate", grad, seed=4, specials=True)
    check_twobit(grad, residual_in, residual_out, threshold=threshold)


def test_twobit_decode_reads_every_code_pattern():
    n = 1000
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-(2**31), 2**31, ((n + 15) // 16,), generator=generator, dtype=torch.int64)
    codes = codes.to(torch.int32)  # every 2-bit pattern, 0b11 (NaN) included
    got, want = run_both("twobit_decompress_add", lambda: (codes.clone(), 0.25, gaussian(n, 6)))
    assert_same_bits(got[2], want[2], "decoded sum")
    assert torch.isnan(got[2]).any()


def test_twobit_unused_bits_of_the_last_word_are_zero():
    grad = torch.full((17,), 100.0)
    codes = torch.full((2,), -1, dtype=torch.int32)
    KERNELS[("twobit_compress", "numba")](grad, None, None, THRESHOLD, codes)
    assert codes.tolist() == [0x55555555, 1]


# ----------------------------------------------------------------------------------------
# Top-k.
# ----------------------------------------------------------------------------------------


def check_topk(grad, residual_in, residual_out, k, values_dtype=None, index_dtype=torch.int32, seed=0):
    n = grad.numel()
    nan_equal = grad.dtype == torch.float16  # see the module docstring
    values = torch.zeros(k, dtype=values_dtype or grad.dtype)
    indices = torch.full((k,), -1, dtype=index_dtype)
    got, want = run_both(
        "topk_compress", lambda: (*compress_args(grad, residual_in, residual_out), values.clone(), indices.clone())
    )
    assert torch.equal(got[4], want[4]), "indices"
    assert_same_bits(got[3], want[3], "values", nan_equal)
    if residual_out is not None:
        assert_same_bits(got[2], want[2], "residual_out", nan_equal)
    if residual_in is not None and residual_out is not residual_in:
        assert_same_bits(got[1], want[1], "residual_in must not change")
    out = gaussian(n, seed + 11)
    out[want[4][: min(k, 2)].long()] = -0.0
    got_out, want_out = run_both("topk_decompress_add", lambda: (want[3].clone(), want[4].clone(), out.clone()))
    assert_same_bits(got_out[2], want_out[2], "decoded sum", nan_equal or values.dtype == torch.float16)


def ks(n):
    return sorted({1, max(1, n // 1000), max(1, n // 100), max(1, n // 10), n})


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 1000, 3 * 8192 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", RESIDUAL_MODES)
def test_topk_matches_reference(n, dtype, mode):
    grad = make_grad(n, dtype, seed=n + 100, specials=True)
    residual_in, residual_out = residuals(mode, grad, seed=n + 101, specials=True)
    for k in ks(n):
        check_topk(grad, residual_in, residual_out, k, seed=k)


@pytest.mark.parametrize("n", [70_001, 300_000])
@pytest.mark.parametrize("specials", [False, True])
def test_topk_matches_reference_on_several_chunks(n, specials):
    grad = make_grad(n, torch.float32, seed=n, specials=specials)
    residual_in, residual_out = residuals("inplace", grad, seed=n + 1, specials=specials)
    for k in (1, n // 100, n // 10):
        check_topk(grad, residual_in, residual_out, k)


@pytest.fixture
def many_chunks(monkeypatch):
    """Chunks of ~64 elements, so small inputs span dozens of chunks (and ties straddle
    chunk boundaries)."""
    monkeypatch.setattr(numba_topk, "MIN_CHUNK", 64)


@pytest.mark.parametrize("values_kind", ["gaussian", "all_equal", "few_levels", "zeros_and_negative_zeros"])
def test_topk_ties_go_to_the_lower_index(many_chunks, values_kind):
    n = 5000
    generator = torch.Generator().manual_seed(9)
    if values_kind == "gaussian":
        grad = torch.randn(n, generator=generator)
    elif values_kind == "all_equal":
        grad = torch.full((n,), -0.75)
    elif values_kind == "few_levels":
        grad = torch.randint(-3, 4, (n,), generator=generator).float() / 4
    else:
        grad = torch.where(torch.rand(n, generator=generator) < 0.5, 0.0, -0.0)
    assert numba_topk.chunk_count(n) > 40
    for k in (1, 2, 17, 999, 2500, n - 1, n):
        check_topk(grad, None, torch.empty(n), k)
        check_topk(grad.to(torch.bfloat16), grad.clone(), None, k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_on_many_chunks_with_residual(many_chunks, dtype):
    grad = make_grad(20_000, dtype, seed=2, specials=True)
    residual_in, residual_out = residuals("inplace", grad, seed=3, specials=True)
    for k in (1, 200, 2000, 20_000):
        check_topk(grad, residual_in, residual_out, k)


def test_topk_int64_indices():
    grad = make_grad(5000, torch.float32, seed=4, specials=True)
    residual_in, residual_out = residuals("separate", grad, seed=5, specials=True)
    check_topk(grad, residual_in, residual_out, 50, index_dtype=torch.int64)


def test_topk_nan_and_inf_are_the_largest():
    grad = gaussian(1000, 6)
    grad[[10, 500]] = float("nan")
    grad[[3, 999]] = torch.tensor([float("inf"), -float("inf")])
    values, indices = torch.empty(4), torch.empty(4, dtype=torch.int32)
    KERNELS[("topk_compress", "numba")](grad, None, None, values, indices)
    assert indices.tolist() == [3, 10, 500, 999]


def test_every_nan_has_the_same_magnitude(many_chunks):
    """NaN payloads and signs do not order NaNs: they tie, and go by index."""
    grad = gaussian(5000, 8)
    nans = {4900: 0x7FC00000, 3: -0x00400000, 2500: 0x7F800001, 77: 0x7FFFFFFF, 640: -0x00600000, 12: 0x7FC12345}
    grad.view(torch.int32)[list(nans)] = torch.tensor(list(nans.values()), dtype=torch.int32)
    grad[1000] = float("inf")
    values, indices = torch.empty(3), torch.empty(3, dtype=torch.int32)
    KERNELS[("topk_compress", "numba")](grad, None, None, values, indices)
    assert indices.tolist() == [3, 12, 77]
    for k in range(1, 9):
        check_topk(grad, None, torch.empty(grad.numel()), k)
        check_topk(grad, gaussian(grad.numel(), 9), torch.empty(grad.numel()), k, values_dtype=torch.bfloat16)


@pytest.mark.parametrize("values_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_to_half_casts_match_torch_bit_for_bit(values_dtype):
    """With k == n every element is sent, so ``values`` is the cast of ``acc`` as a whole:
    random bit patterns (NaN payloads, subnormals, overflow, rounding ties) included."""
    patterns = torch.randint(-(2**31), 2**31, (1 << 16,), generator=torch.Generator().manual_seed(7), dtype=torch.int64)
    grad = patterns.to(torch.int32).view(torch.float32).clone()
    # Exact rounding ties of both formats, and the edges of their ranges.
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x3F801000, 0x3F803000, 0x477FF000, 0x477FEFFF, 0x33000000,
                         0x33000001, 0x387FC000, 0x7F7FFFFF, 0x00000001, 0x80000000], dtype=torch.int64)
    grad[: ties.numel()] = ties.to(torch.int32).view(torch.float32)
    check_topk(grad, None, torch.empty(grad.numel()), grad.numel(), values_dtype=values_dtype)


def test_every_float16_pattern_converts_to_float32_like_torch():
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    nan = (patterns & 0x7C00) == 0x7C00
    nan &= (patterns & 0x3FF) != 0
    signalling = nan & ((patterns & 0x200) == 0)
    # torch converts a signalling NaN two ways, and any NaN in the tail of its vector
    # loop to 0x7FFFFFFF: drop the former, keep NaNs first, and pad to a multiple of 64.
    kept = torch.cat([patterns[nan & ~signalling], patterns[~nan]])
    kept = torch.cat([kept, torch.zeros(-kept.numel() % 64, dtype=torch.int16)])
    grad = kept.view(torch.float16)
    numel = grad.numel()
    for values_dtype in (torch.float32, torch.float16):
        values, indices = torch.empty(numel, dtype=values_dtype), torch.empty(numel, dtype=torch.int32)
        got, want = run_both(
            "topk_compress", lambda: (grad.clone(), None, torch.empty(numel), values.clone(), indices.clone())
        )
        assert torch.equal(got[4], want[4])
        assert_same_bits(got[3], want[3], f"values as {values_dtype}")
        assert_same_bits(got[2], want[2], "residual_out")


@pytest.mark.parametrize("n", [0, 5])
def test_topk_with_nothing_to_send(n):
    """``TopK`` sends k = 0 entries of an empty tensor; the residual is then acc."""
    grad = gaussian(n, 1)
    check_topk(grad, gaussian(n, 2), torch.empty(n), 0)


def test_topk_rejects_bad_arguments():
    op = KERNELS[("topk_compress", "numba")]
    with pytest.raises(ValueError, match="k <= n"):
        op(torch.ones(3), None, None, torch.empty(4), torch.empty(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="grad"):
        op(torch.ones(3, dtype=torch.float64), None, None, torch.empty(1), torch.empty(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="codes"):
        KERNELS[("twobit_compress", "numba")](torch.ones(40), None, None, THRESHOLD, torch.empty(2, dtype=torch.int32))


# ----------------------------------------------------------------------------------------
# Properties.
# ----------------------------------------------------------------------------------------

_SPECIAL = st.sampled_from([0.0, -0.0, 1e-45, -1e-40, float("inf"), -float("inf"), float("nan"), THRESHOLD, -THRESHOLD])


@given(
    data=st.lists(st.one_of(st.floats(-4, 4, width=32), _SPECIAL), min_size=1, max_size=200),
    dtype=st.sampled_from(DTYPES),
    mode=st.sampled_from(RESIDUAL_MODES),
    ratio=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_property_numba_equals_reference(data, dtype, mode, ratio, seed):
    grad = torch.tensor(data, dtype=torch.float32).to(dtype)
    residual_in, residual_out = residuals(mode, grad, seed, specials=False)
    if residual_in is not None:
        residual_in[~torch.isfinite(grad.float())] = 0.25  # no NaN + NaN (see the module docstring)
    check_twobit(grad, residual_in, residual_out, seed=seed)
    k = max(1, min(grad.numel(), round(ratio * grad.numel())))
    check_topk(grad, residual_in, residual_out, k, seed=seed)


# ----------------------------------------------------------------------------------------
# Determinism across thread counts.
# ----------------------------------------------------------------------------------------

_THREADS_SCRIPT = textwrap.dedent(
    """
    import numba, torch
    from gradcomp.backends import KERNELS
    import gradcomp.backends.numba

    def run(threads):
        torch.set_num_threads(threads)  # the ops run on torch's thread count (within Numba's limit)
        generator = torch.Generator().manual_seed(0)
        grad = torch.randn(1_000_003, generator=generator)
        residual = torch.randn(grad.numel(), generator=generator)
        grad[::97] = 2.5 - residual[::97]  # ~10k ties at |acc| = 2.5, around the k-th largest
        values, indices = torch.empty(15_000), torch.empty(15_000, dtype=torch.int32)
        topk_residual = residual.clone()
        KERNELS[("topk_compress", "numba")](grad, topk_residual, topk_residual, values, indices)
        codes = torch.empty((grad.numel() + 15) // 16, dtype=torch.int32)
        twobit_residual = residual.clone()
        KERNELS[("twobit_compress", "numba")](grad, twobit_residual, twobit_residual, 0.5, codes)
        out = torch.zeros(grad.numel())
        KERNELS[("twobit_decompress_add", "numba")](codes, 0.5, out)
        KERNELS[("topk_decompress_add", "numba")](values, indices, out)
        chunked = []
        for op, per_word, chunk in (("twobit_chunk", 16, 64), ("threebit", 10, 128)):
            words = torch.empty(-(-grad.numel() // per_word), dtype=torch.int32)
            scales, chunk_residual = torch.empty(-(-grad.numel() // chunk)), residual.clone()
            KERNELS[(op + "_compress", "numba")](grad, chunk_residual, chunk_residual, words, scales)
            KERNELS[(op + "_decompress_add", "numba")](words, scales, out)
            chunked += [words, scales, chunk_residual]
        return [t.view(torch.int32) for t in [values, indices, topk_residual, codes, twobit_residual, out] + chunked]

    one = run(1)
    assert numba.get_num_threads() == 1
    two = run(2)
    assert numba.get_num_threads() == 2
    assert all(torch.equal(a, b) for a, b in zip(one, two)), "results depend on the thread count"
    print("same")
    """
)


def test_results_do_not_depend_on_the_thread_count():
    # The test session may pin Numba to one thread (NUMBA_NUM_THREADS is read once, at
    # import), so the comparison runs in a child allowed two.
    env = dict(os.environ, NUMBA_NUM_THREADS="2", OMP_NUM_THREADS="2")
    result = subprocess.run(
        [sys.executable, "-c", _THREADS_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and "same" in result.stdout, result.stderr[-3000:]


_POOL_SCRIPT = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "numba-first":  # torch then shares Numba's OpenMP runtime
        import numba
    import torch
    torch.set_num_threads(1)
    import numba
    from gradcomp.compressors.threebit import ThreeBit

    def launch():
        ThreeBit().compress(torch.randn(3000), torch.zeros(3000), torch.zeros(3000), backend="numba")
        return numba.get_num_threads(), torch.get_num_threads()

    first = launch()
    torch.set_num_threads(2)
    print(first, launch())
    """
)


@pytest.mark.parametrize("order", ["numba-first", "torch-first"])
def test_kernels_run_on_torchs_threads_and_leave_them(order):
    # A rank pinned to one torch thread (torchrun sets OMP_NUM_THREADS=1) runs the kernels on one
    # thread, however many Numba allows: two such processes on two cores with Numba's whole pool each
    # took 65x longer a launch (experiments.bench_threads). And torch's own count stays the user's.
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    result = subprocess.run([sys.executable, "-c", _POOL_SCRIPT, order], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["(1,", "1)", "(2,", "2)"], result.stdout


_CONCURRENT_SCRIPT = r"""
import threading, torch
from gradcomp.backends import torch_ops
from gradcomp.backends.numba import ops as numba_ops
errors = []
def work(seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(30):
        grad = torch.randn(300_000, generator=gen)
        got_v, got_i = torch.empty(3000), torch.empty(3000, dtype=torch.int32)
        want_v, want_i = torch.empty(3000), torch.empty(3000, dtype=torch.int32)
        numba_ops.topk_compress(grad, None, None, got_v, got_i)
        torch_ops.topk_compress(grad, None, None, want_v, want_i)
        codes, want_codes = torch.empty(18750, dtype=torch.int32), torch.empty(18750, dtype=torch.int32)
        numba_ops.twobit_compress(grad, None, None, 0.5, codes)
        torch_ops.twobit_compress(grad, None, None, 0.5, want_codes)
        if not (torch.equal(got_i, want_i) and torch.equal(got_v, want_v) and torch.equal(codes, want_codes)):
            errors.append(seed)
threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
[t.start() for t in threads]; [t.join() for t in threads]
assert not errors, errors
print("ok")
"""


def test_ops_called_from_two_threads_at_once_stay_correct():
    # DDP compresses on the backward thread while Gloo's callback thread decompresses.
    # Parallel kernels release the GIL, so without the kernel lock the shared top-k
    # scratch races and Numba's workqueue layer aborts the whole process.
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", "NUMBA_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", _CONCURRENT_SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_backend_choice_is_logged_once_per_device_type(caplog, monkeypatch):
    import gradcomp.backends as backends

    monkeypatch.setattr(backends, "_logged_choices", set())
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    with caplog.at_level("INFO", logger="gradcomp.backends"):
        for _ in range(3):
            backends.kernel("topk_compress", "cpu")
            backends.kernel("topk_compress", "cpu", "torch")
    lines = [record.getMessage() for record in caplog.records if record.name == "gradcomp.backends"]
    assert lines == [
        "gradcomp kernels for cpu tensors: backend 'numba' (automatic)",
        "gradcomp kernels for cpu tensors: backend 'torch' (requested)",
    ], lines
