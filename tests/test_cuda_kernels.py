"""The CUDA backend without a GPU.

* Every ``csrc/*.cu`` builds with nvcc for real GPU architectures, and the one translation
  unit that CuPy hands to NVRTC compiles too.
* Every kernel runs in the CPU emulation of ``tests/emulation`` -- launched by the same
  launch plans that ``gradcomp.backends.cuda_ops`` runs on a GPU, with tiny blocks and grids
  so that small inputs span several blocks and every grid-stride loop wraps -- and matches
  the torch reference bit for bit.
* The backend registers itself when CuPy imports, and fails with a clear message, at call
  time, where there is no GPU.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradcomp
import gradcomp.backends
import gradcomp.csrc
from gradcomp.backends import checks, cuda_source, torch_ops
from gradcomp.compressors.per_parameter import PerParameter

TESTS_DIR = Path(__file__).resolve().parent
SOURCE_DIR = Path(gradcomp.csrc.__file__).resolve().parent
CU_FILES = sorted(path.name for path in SOURCE_DIR.glob("*.cu"))
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ("f32", "f16", "bf16")
# How the error-feedback residual is passed: (residual_in given, residual_out given, aliased).
RESIDUAL_MODES = {
    "none": (False, False, False),
    "in-only": (True, False, False),
    "out-only": (False, True, False),
    "separate": (True, True, False),
    "aliased": (True, True, True),
}


def _load_path(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


cuda_emulator = _load_path("gradcomp_tests_cuda_emulator", TESTS_DIR / "emulation" / "cuda_emulator.py")


cuda_ops = cuda_emulator.load_cuda_plans()
# Tiny launches: 32-thread blocks and at most 3 blocks, so a few thousand elements already
# wrap every grid-stride loop several times.
TINY = cuda_ops.LaunchConfig(threads=32, max_blocks=3, histogram_blocks=3)


def build_emulator():
    """The launcher of every csrc/ kernel on the CPU emulation; skips the test where g++ is missing."""
    try:
        library = cuda_emulator.build(SOURCE_DIR)
    except FileNotFoundError as error:  # no g++
        pytest.skip(f"the CUDA emulation needs a C++20 compiler ({cuda_emulator.CXX}): {error}")
    return cuda_emulator.EmulatedLauncher(library)


@pytest.fixture(scope="module")
def emulator():
    return build_emulator()


# --- comparing with the reference ---------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    integer = {4: torch.int32, 2: torch.int16, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer)


def assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit for bit, except that any NaN equals any NaN (their payloads legitimately
    differ: torch's vectorised casts and the GPU canonicalise NaNs differently)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    if not actual.dtype.is_floating_point:
        mismatch = (actual != expected).nonzero().flatten()
    else:
        nan_actual, nan_expected = torch.isnan(actual), torch.isnan(expected)
        differ = (_bits(actual) != _bits(expected)) & ~(nan_actual & nan_expected)
        mismatch = (differ | (nan_actual != nan_expected)).nonzero().flatten()
    if mismatch.numel():
        i = mismatch[:5].tolist()
        pytest.fail(
            f"{what}: {mismatch.numel()} of {actual.numel()} differ; first at {i}: "
            f"got {actual[i].tolist()}, expected {expected[i].tolist()}"
        )


class Guarded:
    """A tensor inside a larger buffer whose margins hold a sentinel: out-of-bounds writes
    by a kernel (e.g. past the last code word) show up as a changed margin."""

    MARGIN = 17

    def __init__(self, numel: int, dtype: torch.dtype, fill=None):
        self.buffer = torch.empty(numel + 2 * self.MARGIN, dtype=dtype)
        _bits(self.buffer).fill_(0x5A)
        self.tensor = self.buffer[self.MARGIN : self.MARGIN + numel]
        if fill is not None:
            self.tensor.copy_(fill)
        self.sentinel = _bits(self.buffer).clone()

    def check(self, what: str) -> None:
        bits = _bits(self.buffer)
        m = self.MARGIN
        assert torch.equal(bits[:m], self.sentinel[:m]), f"{what}: written before its start"
        assert torch.equal(bits[-m:], self.sentinel[-m:]), f"{what}: written past its end"


# --- inputs -------------------------------------------------------------------------


def make_values(kind: str, n: int, seed: int) -> torch.Tensor:
    """float32 test data. ``ties``: few distinct values; ``special``: NaN, +-inf, -0.0,
    subnormals and values beyond float16's range mixed into normal noise."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(n, generator=generator)
    if kind == "ties":
        return torch.randint(-4, 5, (n,), generator=generator).to(torch.float32) * 0.5
    if kind == "zeros":
        signs = torch.randint(0, 2, (n,), generator=generator).to(torch.float32)
        return torch.zeros(n) * (1 - 2 * signs)  # +0.0 and -0.0
    if kind == "special":
        values = torch.randn(n, generator=generator)
        specials = torch.tensor(
            [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3e-39, 7e4, -1e5, 65504.0, 65520.0, 3e38]
        )
        positions = torch.randperm(n, generator=generator)[: min(n, 3 * len(specials))]
        values[positions] = specials[torch.arange(len(positions)) % len(specials)]
        return values
    raise ValueError(kind)


def make_case(dtype, mode, n, kind="normal", seed=0):
    """``(grad, residual_in, residual_out guard or None)``; residual_out aliases residual_in
    in mode ``aliased``."""
    has_in, has_out, aliased = RESIDUAL_MODES[mode]
    grad = make_values(kind, n, seed).to(dtype)
    residual_in = make_values("special" if kind == "special" else "normal", n, seed + 1) * 0.75 if has_in else None
    residual_out = None
    if has_out:
        residual_out = Guarded(n, torch.float32, fill=residual_in if aliased else torch.full((n,), 123.0))
        if aliased:
            residual_in = residual_out.tensor
    return grad, residual_in, residual_out


# --- nvcc and NVRTC -----------------------------------------------------------------

NVCC_ARCHS = ("sm_70", "sm_75", "sm_80", "sm_90")


def _nvcc_supported_archs():
    try:
        listed = subprocess.run(["nvcc", "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError):
        return None
    return {line.strip().replace("compute_", "sm_") for line in listed.split()}


@pytest.fixture(scope="module")
def nvcc_builds(tmp_path_factory):
    """``{(file, arch): (returncode, stderr)}``: each .cu compiled once per supported arch."""
    supported = _nvcc_supported_archs()
    if supported is None:
        pytest.skip("nvcc is not on PATH (it ships with the CUDA toolkit)")
    out_dir = tmp_path_factory.mktemp("nvcc")
    jobs = [(name, arch) for name in CU_FILES for arch in NVCC_ARCHS if arch in supported]

    def compile_one(job):
        name, arch = job
        command = [
            "nvcc", f"-arch={arch}", "-std=c++17", "-c", "-Werror", "all-warnings", "-Wno-deprecated-gpu-targets",
            "-o", str(out_dir / f"{name}.{arch}.o"), str(SOURCE_DIR / name),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        return job, (result.returncode, " ".join(command) + "\n" + result.stderr)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(compile_one, jobs)), supported


# Slow: the fixture compiles every file for every arch (about 10 s on two idle cores); the quick run keeps
# test_cuda_nvrtc_translation_unit_builds_with_nvcc, which builds the same kernels with nvcc in one unit.
@pytest.mark.slow
@pytest.mark.parametrize("arch", NVCC_ARCHS)
@pytest.mark.parametrize("name", CU_FILES)
def test_cuda_source_builds_with_nvcc(nvcc_builds, name, arch):
    builds, supported = nvcc_builds
    if arch not in supported:
        pytest.skip(
            f"this nvcc cannot target {arch} (CUDA 13 dropped sm_70 and older; CUDA 12's NVRTC, which "
            f"cupy-cuda12x uses, still can); it supports {sorted(supported)}"
        )
    returncode, log = builds[(name, arch)]
    assert returncode == 0, log


def test_cuda_nvrtc_translation_unit_builds_with_nvcc(tmp_path):
    """The single source CuPy compiles (headers inlined) is valid CUDA on its own."""
    if _nvcc_supported_archs() is None:
        pytest.skip("nvcc is not on PATH (it ships with the CUDA toolkit)")
    unit = tmp_path / "gradcomp_nvrtc_unit.cu"
    unit.write_text(cuda_source.kernel_source(str(SOURCE_DIR)))
    assert '#include "' not in unit.read_text()
    result = subprocess.run(
        ["nvcc", "-arch=sm_90", "-std=c++17", "-c", "-o", str(tmp_path / "unit.o"), str(unit)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr


def _libnvrtc():
    """NVRTC as CuPy would find it (pip wheels nvidia-cuda-nvrtc-cu12, or a CUDA toolkit)."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib  # ships with CuPy >= 14

        return ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # not installed, or no NVRTC there: look elsewhere
        pass
    candidates = [ctypes.util.find_library("nvrtc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += sorted(map(str, Path(root).glob("lib64/libnvrtc.so*")))
    for candidate in filter(None, candidates):
        try:
            return ctypes.CDLL(candidate)
        except OSError:
            continue
    return None


# The quick run keeps compute_90, which every NVRTC since CUDA 12 targets (compute_70 is skipped by 13).
@pytest.mark.parametrize("arch", [pytest.param("compute_70", marks=pytest.mark.slow),
                                  pytest.param("compute_80", marks=pytest.mark.slow), "compute_90"])
def test_cuda_nvrtc_compiles_module_source(arch):
    """What cuda_ops gives NVRTC -- source and options -- compiles with NVRTC itself (no GPU
    needed), with no headers available, for each architecture."""
    nvrtc = _libnvrtc()
    if nvrtc is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or a CUDA toolkit)")
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    if arch == "compute_70" and major.value >= 13:
        pytest.skip(f"NVRTC {major.value}.{minor.value} cannot target {arch} (dropped in CUDA 13)")
    program = ctypes.c_void_p()
    source = cuda_source.kernel_source(str(SOURCE_DIR)).encode()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"gradcomp.cu", 0, None, None) == 0
    options = [option.encode() for option in cuda_source.NVRTC_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    assert status == 0, log.value.decode(errors="replace")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="cupy is not installed (pip install cupy-cuda12x)")
def test_cuda_module_is_compiled_with_ieee_arithmetic():
    """The module the backend loads keeps denormals and rounds every operation on its own, as the
    torch reference does: its PTX has no flush-to-zero (``.ftz``, which CuPy's own compile path
    forces; on an H200 it made 2-bit decoding drop a denormal of ``out``) and no fused
    multiply-add. Needs NVRTC, not a GPU."""
    try:
        image, kind = cuda_source.compile_image(90, ptx=True)
    except Exception as error:  # NVRTC missing from this CuPy's environment
        pytest.skip(f"NVRTC is not usable here: {type(error).__name__}: {error}")
    text = image.decode()
    assert kind == "ptx" and ".entry gradcomp_twobit_decompress_add" in text
    assert ".ftz" not in text and "fma." not in text
    # 3-bit divides by its chunk's scale: IEEE division, not the approximate one (-prec-div=true).
    assert ".entry gradcomp_threebit_compress_f32" in text and "div.rn.f32" in text
    assert "div.approx" not in text and "div.full" not in text
    assert "add.f32" in text or "add.rn.f32" in text  # there is float arithmetic to look at


# --- 2-bit in the emulation --------------------------------------------------------


def run_twobit_compress(emulator, config, grad, residual_in, residual_out, threshold):
    n = grad.numel()
    codes = Guarded((n + 15) // 16, torch.int32)
    out = residual_out.tensor if residual_out is not None else None
    cuda_ops.plan_twobit_compress(emulator, config, grad, residual_in, out, threshold, codes.tensor)
    codes.check("codes")
    if residual_out is not None:
        residual_out.check("residual_out")
    return codes.tensor


@pytest.mark.parametrize("n", [1, 15, 16, 17, 3109])
@pytest.mark.parametrize("mode", list(RESIDUAL_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_emulated_cuda_twobit_compress_matches_reference(emulator, dtype, mode, n):
    for kind, threshold in (("normal", 0.5), ("ties", 1.0), ("special", 0.25)):
        grad, residual_in, residual_out = make_case(dtype, mode, n, kind, seed=n)
        expected_codes = torch.empty((n + 15) // 16, dtype=torch.int32)
        expected_residual = torch.empty(n)
        reference_in = residual_in.clone() if residual_in is not None else None
        torch_ops.twobit_compress(grad, reference_in, expected_residual, threshold, expected_codes)

        codes = run_twobit_compress(emulator, TINY, grad, residual_in, residual_out, threshold)
        assert_same(codes, expected_codes, f"codes ({kind})")
        if residual_out is not None:
            assert_same(residual_out.tensor, expected_residual, f"residual ({kind})")


@pytest.mark.parametrize("n", [1, 16, 33, 3109])
def test_emulated_cuda_twobit_decompress_add_matches_reference(emulator, n):
    generator = torch.Generator().manual_seed(n)
    codes = torch.randint(-(2**31), 2**31, ((n + 15) // 16,), generator=generator, dtype=torch.int64)
    codes = codes.to(torch.int32)
    if n % 16:  # unused bits of the last word are zero by contract
        codes[-1] &= (1 << (2 * (n % 16))) - 1
    start = make_values("special", n, seed=n)
    start[: min(n, 8)] = -0.0  # -0.0 + 0.0 is +0.0: the kernel must add, not skip
    expected = start.clone()
    torch_ops.twobit_decompress_add(codes, 0.375, expected)

    out = Guarded(n, torch.float32, fill=start)
    cuda_ops.plan_twobit_decompress_add(emulator, TINY, codes, 0.375, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_emulated_cuda_twobit_round_trip_keeps_error_feedback_identity(emulator, dtype):
    """acc == decoded + residual' for every finite element, through the emulated kernels."""
    n = 1000
    grad, residual_in, residual_out = make_case(dtype, "separate", n, "normal", seed=7)
    codes = run_twobit_compress(emulator, TINY, grad, residual_in, residual_out, 0.5)
    decoded = torch.zeros(n)
    cuda_ops.plan_twobit_decompress_add(emulator, TINY, codes, 0.5, decoded)
    acc = grad.float() + residual_in
    torch.testing.assert_close(decoded + residual_out.tensor, acc, rtol=0, atol=1e-6)
    assert set(decoded.unique().tolist()) <= {-0.5, 0.0, 0.5}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulated_cuda_half_loads_are_exact_for_every_bit_pattern(emulator, dtype):
    """All 65536 float16/bfloat16 patterns (subnormals, inf, NaN) widen exactly: with a
    threshold above every value the residual is the widened gradient itself."""
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    n = grad.numel()
    residual = Guarded(n, torch.float32)
    above_all = torch.finfo(torch.float32).max
    codes = run_twobit_compress(emulator, TINY, grad, None, residual, above_all)
    expected_codes = torch.empty_like(codes)
    torch_ops.twobit_compress(grad, None, None, above_all, expected_codes)
    assert_same(residual.tensor, grad.float(), "widened gradient")
    assert_same(codes, expected_codes, "codes")


def _rounding_cases(dtype: torch.dtype, count: int) -> torch.Tensor:
    """float32 values on and next to the rounding boundaries of ``dtype``: each sampled
    representable value, the midpoint to its successor, and the float32 neighbours of both."""
    generator = numpy.random.default_rng(5)
    patterns = numpy.arange(0, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=numpy.int32)
    chosen = numpy.concatenate([patterns[:40], patterns[-40:], generator.choice(patterns, count, replace=False)])
    def value(bits):
        return torch.from_numpy(bits.astype(numpy.int16)).view(dtype).double().numpy()

    low, high = value(chosen), value(chosen + 1)  # high is inf above the largest finite value
    midpoint = numpy.where(numpy.isinf(high), low + (low - value(numpy.maximum(chosen - 1, 0))) / 2, (low + high) / 2)
    points = numpy.concatenate([low, midpoint]).astype(numpy.float32)  # exact: 16-bit midpoints fit in float32
    neighbours = [numpy.nextafter(points, numpy.float32(numpy.inf)), numpy.nextafter(points, numpy.float32(0))]
    extremes = numpy.array([65519.996, 65520.0, 3.4e38, 1e-45], numpy.float32)
    values = numpy.concatenate([points] + neighbours + [extremes])
    values = numpy.concatenate([values, -values])
    return torch.from_numpy(values)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulated_cuda_half_stores_round_to_nearest_even(emulator, dtype):
    """Top-k values are acc cast to the gradient dtype exactly as torch casts, ties to even,
    overflow to inf, underflow through the subnormals to zero (k = n keeps every value)."""
    targets = _rounding_cases(dtype, 700)
    n = targets.numel()
    grad = torch.zeros(n, dtype=dtype)  # acc = 0 + residual = the target, exactly
    expected_values = torch.empty(n, dtype=dtype)
    expected_indices = torch.empty(n, dtype=torch.int32)
    expected_residual = torch.empty(n)
    torch_ops.topk_compress(grad, targets, expected_residual, expected_values, expected_indices)
    residual = Guarded(n, torch.float32)
    config = cuda_ops.LaunchConfig(threads=64, max_blocks=3, histogram_blocks=3)
    values, indices = run_topk_compress(emulator, config, grad, targets, residual, n, torch.int32)
    assert_same(values, expected_values, "values")
    assert_same(values, (0.0 + targets).to(dtype), "values")  # 0.0 + -0.0 is +0.0
    assert_same(indices, expected_indices, "indices")
    assert_same(residual.tensor, expected_residual, "residual")


# --- top-k in the emulation ---------------------------------------------------------


def run_topk_compress(emulator, config, grad, residual_in, residual_out, k, index_dtype):
    values = Guarded(k, grad.dtype)
    indices = Guarded(k, index_dtype)
    out = residual_out.tensor if residual_out is not None else None
    cuda_ops.plan_topk_compress(emulator, config, grad, residual_in, out, values.tensor, indices.tensor)
    values.check("values")
    indices.check("indices")
    if residual_out is not None:
        residual_out.check("residual_out")
    return values.tensor, indices.tensor


def reference_topk_compress(grad, residual_in, residual_out, values, indices):
    """The torch reference, run on the gradient widened to float32 with every NaN made the
    same NaN. The kernels give every NaN one key (NaN payloads are not portable), while the
    reference ranks NaNs by payload, and torch's float16 widening itself yields different
    NaN payloads in its vectorised and scalar paths. ``values`` keeps the gradient dtype."""
    widened = grad.float()
    widened = torch.where(torch.isnan(widened), torch.full_like(widened, float("nan")), widened)
    residual_in = residual_in.clone() if residual_in is not None else None
    torch_ops.topk_compress(widened, residual_in, residual_out, values, indices)


def check_topk_compress(emulator, config, dtype, mode, n, k, kind, index_dtype=torch.int32, seed=0):
    grad, residual_in, residual_out = make_case(dtype, mode, n, kind, seed)
    expected_values = torch.empty(k, dtype=dtype)
    expected_indices = torch.empty(k, dtype=index_dtype)
    expected_residual = torch.empty(n)
    reference_topk_compress(grad, residual_in, expected_residual, expected_values, expected_indices)

    values, indices = run_topk_compress(emulator, config, grad, residual_in, residual_out, k, index_dtype)
    what = f"{kind}, n={n}, k={k}"
    assert_same(indices, expected_indices, f"indices ({what})")
    assert_same(values, expected_values, f"values ({what})")
    if residual_out is not None:
        assert_same(residual_out.tensor, expected_residual, f"residual ({what})")


TOPK_CASES = [  # (n, k, kind)
    (1, 1, "normal"),
    (1000, 1, "normal"),
    (3001, 29, "normal"),  # several tiles per block
    (777, 100, "ties"),  # many ties at the threshold: the lowest indices win
    (300, 37, "zeros"),  # every key equal (and +-0.0 have the same magnitude)
    (500, 5, "special"),  # NaN > inf > finite
    (500, 40, "special"),
    (203, 203, "ties"),  # k = n
]


@pytest.mark.parametrize("n,k,kind", TOPK_CASES, ids=[f"n{n}-k{k}-{kind}" for n, k, kind in TOPK_CASES])
@pytest.mark.parametrize("mode", list(RESIDUAL_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_emulated_cuda_topk_compress_matches_reference(emulator, dtype, mode, n, k, kind):
    check_topk_compress(emulator, TINY, dtype, mode, n, k, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_emulated_cuda_topk_compress_int64_indices(emulator, dtype):
    """The int64-index kernels (used from n >= 2**31) on a small input."""
    check_topk_compress(emulator, TINY, dtype, "aliased", 900, 77, "ties", index_dtype=torch.int64)


@pytest.mark.parametrize("threads,max_blocks", [(1, 2), (7, 5), (64, 4), (256, 2)])
def test_emulated_cuda_topk_compress_any_launch_shape(emulator, threads, max_blocks):
    """Block sizes that are not powers of two, a single thread, and the maximum block."""
    config = cuda_ops.LaunchConfig(threads=threads, max_blocks=max_blocks, histogram_blocks=max_blocks)
    n = 600 if threads > 1 else 150
    check_topk_compress(emulator, config, torch.float16, "separate", n, 45, "ties", seed=threads)
    grad, residual_in, residual_out = make_case(torch.float32, "aliased", n, "special", seed=threads)
    expected_codes = torch.empty((n + 15) // 16, dtype=torch.int32)
    torch_ops.twobit_compress(grad, residual_in.clone(), None, 0.5, expected_codes)
    codes = run_twobit_compress(emulator, config, grad, residual_in, residual_out, 0.5)
    assert_same(codes, expected_codes, "codes")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 400),
    ratio=st.floats(0.0, 1.0),
    kind=st.sampled_from(["normal", "ties", "special", "zeros"]),
    seed=st.integers(0, 2**16),
)
def test_emulated_cuda_topk_compress_property(emulator, n, ratio, kind, seed):
    k = max(1, min(n, round(ratio * n)))
    check_topk_compress(emulator, TINY, torch.float32, "separate", n, k, kind, seed=seed)


def test_emulated_cuda_topk_nans_tie_whatever_their_payload(emulator):
    """NaNs outrank inf and each other never: the lowest-indexed NaNs are taken."""
    n = 300
    grad = torch.randn(n)
    payloads = [0x7FC00000, 0x7FFFFFFF, -0x00400000, 0x7F800001, 0x7FC12345]  # quiet, max, negative, signalling
    positions = [250, 20, 199, 3, 120]
    grad.view(torch.int32)[positions] = torch.tensor(payloads, dtype=torch.int32)
    grad[[5, 290]] = float("inf")
    values, indices = run_topk_compress(emulator, TINY, grad, None, None, 4, torch.int32)
    assert indices.tolist() == [3, 20, 120, 199]
    values, indices = run_topk_compress(emulator, TINY, grad, None, None, 6, torch.int32)
    assert indices.tolist() == [3, 5, 20, 120, 199, 250]
    assert torch.isnan(values[[0, 2, 3, 4, 5]]).all() and values[1] == float("inf")


def test_emulated_cuda_topk_compress_k_zero_writes_residual(emulator):
    grad, residual_in, residual_out = make_case(torch.bfloat16, "separate", 100, "normal")
    run_topk_compress(emulator, TINY, grad, residual_in, residual_out, 0, torch.int32)
    assert_same(residual_out.tensor, grad.float() + residual_in, "residual")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_emulated_cuda_topk_decompress_add_matches_reference(emulator, dtype, index_dtype):
    n, k = 2000, 333
    generator = torch.Generator().manual_seed(k)
    indices = torch.randperm(n, generator=generator)[:k].sort().values.to(index_dtype)
    values = make_values("special", k, seed=3).to(dtype)
    start = make_values("normal", n, seed=4)
    expected = start.clone()
    torch_ops.topk_decompress_add(values, indices, expected)

    out = Guarded(n, torch.float32, fill=start)
    cuda_ops.plan_topk_decompress_add(emulator, TINY, values, indices, out.tensor)
    out.check("out")
    assert_same(out.tensor, expected, "out")


# --- the emulation itself ---------------------------------------------------------


def test_emulation_executes_every_cuda_kernel(emulator):
    """Every extern "C" kernel of csrc/ is launched by some op's plan (a kernel that no
    test executes does not count as done)."""
    launcher = cuda_emulator.EmulatedLauncher(cuda_emulator.build(SOURCE_DIR))
    for dtype in DTYPES:
        grad, residual_in, residual_out = make_case(dtype, "separate", 40, "normal")
        codes = run_twobit_compress(launcher, TINY, grad, residual_in, residual_out, 0.5)
        cuda_ops.plan_twobit_decompress_add(launcher, TINY, codes, 0.5, torch.zeros(40))
        for index_dtype in (torch.int32, torch.int64):
            values, indices = run_topk_compress(launcher, TINY, grad, residual_in, residual_out, 4, index_dtype)
            cuda_ops.plan_topk_decompress_add(launcher, TINY, values, indices, torch.zeros(40))
        codes, scales = torch.empty(3, dtype=torch.int32), torch.empty(1)  # the chunk-scaled 2-bit code
        cuda_ops.plan_twobit_chunk_compress(launcher, TINY, grad, residual_in, residual_out.tensor, codes, scales)
        cuda_ops.plan_twobit_chunk_decompress_add(launcher, TINY, codes, scales, torch.zeros(40))
        codes, scales = torch.empty(4, dtype=torch.int32), torch.empty(1)  # the 3-bit code
        cuda_ops.plan_threebit_compress(launcher, TINY, grad, residual_in, residual_out.tensor, codes, scales)
        cuda_ops.plan_threebit_decompress_add(launcher, TINY, codes, scales, torch.zeros(40))
    # compact top-k's encode and check over a group's parts (tests/test_cuda_compact.py compares them)
    plan = PerParameter(gradcomp.TopK(0.02, entries="compact"), (70_000, 3000))._plan(torch.float32)
    indices = torch.tensor([5, 70_000 - 1, 7], dtype=torch.int32)
    buffer = plan.whole.allocate(torch.device("cpu")).buffer
    parts = plan.sparse["cpu"]._replace(k=torch.tensor([2, 1]))  # two entries of the first part, one of the second
    assert cuda_ops.plan_compact_encode(launcher, TINY, parts, torch.ones(3), indices, buffer, torch.zeros(73_000))
    assert cuda_ops.plan_compact_entries(launcher, TINY, parts, buffer)[0].tolist() == [5, 70_000 - 1, 70_007]
    assert launcher.kernel_names, "the emulation found no kernels"
    assert set(launcher.launches) == set(launcher.kernel_names)


def test_emulation_cuda_host_constants_match_kernels(emulator):
    """The host's view of the kernels' compile-time limits matches the sources."""
    assert emulator.max_threads == cuda_ops.MAX_THREADS
    passes = cuda_ops.TOPK_PASSES
    assert sum(bits for _, bits in passes) == 31, "the passes must cover the 31-bit key"
    assert all(shift == sum(bits for _, bits in passes[i + 1 :]) for i, (shift, _) in enumerate(passes))
    assert max(bits for _, bits in passes) <= 11, "GRADCOMP_TOPK_MAX_BINS is 2048"
    source = (SOURCE_DIR / "threebit.cu").read_text()
    chunk = int(re.search(r"#define GRADCOMP_THREEBIT_CHUNK (\d+)", source).group(1))
    tile_chunks = int(re.search(r"#define GRADCOMP_THREEBIT_TILE_CHUNKS (\d+)", source).group(1))
    assert chunk == checks.THREEBIT_CHUNK == cuda_ops.THREEBIT_THREADS
    assert chunk * tile_chunks == cuda_ops.THREEBIT_TILE and cuda_ops.THREEBIT_TILE % checks.THREEBIT_PER_WORD == 0


def test_emulation_rejects_mistyped_cuda_kernel_arguments(emulator):
    """A Python float (CuPy would pack a double) or a wrong argument count never runs."""
    codes, out = torch.zeros(1, dtype=torch.int32), torch.zeros(16)
    args = [numpy.uint64(codes.data_ptr()), 0.5, numpy.uint64(out.data_ptr()), numpy.int64(16)]
    with pytest.raises(cuda_emulator.EmulationError, match="numpy.float32"):
        emulator("gradcomp_twobit_decompress_add", 1, 32, args)
    args[1] = numpy.int32(1)
    with pytest.raises(cuda_emulator.EmulationError, match="argument 1"):
        emulator("gradcomp_twobit_decompress_add", 1, 32, args)
    with pytest.raises(cuda_emulator.EmulationError, match="takes 4 arguments"):
        emulator("gradcomp_twobit_decompress_add", 1, 32, args[:3])
    with pytest.raises(cuda_emulator.EmulationError, match="exceeds GRADCOMP_MAX_THREADS"):
        emulator("gradcomp_twobit_decompress_add", 1, emulator.max_threads + 1, args)


def test_emulation_reports_divergent_cuda_syncthreads(tmp_path):
    """A __syncthreads reached by only part of a block is undefined on a GPU; the emulation
    reports it instead of letting the kernel pass by luck."""
    (tmp_path / "bad.cu").write_text(
        textwrap.dedent(
            """
            extern "C" __global__ void divergent(int* out) {
              if (threadIdx.x < 2) { __syncthreads(); } else { __syncthreads(); }
              atomicAdd(out, 1);
            }
            """
        )
    )
    launcher = cuda_emulator.EmulatedLauncher(cuda_emulator.build(tmp_path, cache_dir=tmp_path / "cache"))
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(cuda_emulator.EmulationError, match="divergent __syncthreads"):
        launcher("divergent", 2, 4, [numpy.uint64(out.data_ptr())])
    assert out.item() == 8  # every thread of both blocks still ran to the end


# --- the backend in the registry ----------------------------------------------------

_has_cupy = importlib.util.find_spec("cupy") is not None


@pytest.mark.skipif(not _has_cupy, reason="cupy is not installed (pip install cupy-cuda12x)")
def test_cuda_backend_registers_its_ops_when_cupy_imports():
    from gradcomp.backends import FORMS, KERNELS, OPS, is_available

    assert is_available("cuda")
    import gradcomp.backends.cuda_ops as real_cuda_ops

    for op in OPS:
        assert KERNELS[(op, "cuda")] is getattr(real_cuda_ops, op)
    for op in FORMS["sparse_parts"]:
        assert KERNELS[(f"{op}/sparse_parts", "cuda")] is getattr(real_cuda_ops, op)


@pytest.mark.skipif(not _has_cupy, reason="cupy is not installed (pip install cupy-cuda12x)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: nothing to fail")
def test_cuda_backend_without_gpu_fails_clearly_at_call_time():
    import gradcomp.backends.cuda_ops as real_cuda_ops
    from gradcomp import TwoBit
    from gradcomp.backends import kernel

    grad = torch.randn(40)
    with pytest.raises(RuntimeError, match="one CUDA device.*backend='torch'"):
        kernel("twobit_compress", "cuda")(grad, None, None, 0.5, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="could not compile its kernels for CUDA device 0.*CUDA GPU"):
        real_cuda_ops.device_launcher(0)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        TwoBit(0.5).compress(grad, backend="cuda")


def test_cuda_backend_unavailable_without_cupy_does_not_break_import():
    """With CuPy missing, importing gradcomp works, the cuda backend reports unavailable and
    asking for it explains how to install it."""
    script = textwrap.dedent(
        """
        import sys
        sys.modules["cupy"] = None  # import cupy now raises ImportError
        import torch, gradcomp
        from gradcomp.backends import is_available, resolve_backend
        assert not is_available("cuda")
        try:
            resolve_backend("cuda", "cuda")
        except RuntimeError as error:
            assert "pip install cupy" in str(error), error
        else:
            raise AssertionError("resolve_backend('cuda', 'cuda') did not raise")
        assert resolve_backend("cuda") == "torch"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
