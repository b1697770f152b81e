"""GPU self-check of the ``cuda`` backend: correctness against the torch reference, then speed.

For the day a GPU is available (no machine of this project has one; the tests run the
same kernels in a CPU emulation). On the first CUDA device it

1. runs every cuda op against the torch reference on the GPU -- float32/float16/bfloat16,
   with and without (and with aliased) residual, ties, NaN/inf, k = 1 and k = n, sizes
   that are not multiples of 16 -- and compares bit for bit (any NaN equals any NaN), and
   checks the compressors give the same payloads on both backends;
2. times each op against the torch reference and against a device-to-device copy, and
   prints a table: time, effective GB/s (minimal bytes the op must move / time) and that
   as a percentage of the measured copy bandwidth.

Usage::

    python experiments/gpu_selfcheck.py [--sizes 65536,1048576,16777216] [--density 0.01] [--repeats 30]

Exit status: 0 when everything matches, 1 on any mismatch, 2 when there is no GPU or CuPy.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Callable, Dict, List, Optional

import torch

from gradcomp.backends import OPS

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# --- correctness ------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    integer = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}[tensor.element_size()]
    return tensor.contiguous().view(integer)


class Mismatch(int):
    """How many elements differ (an int), printed with the first few: index, got, expected (bits)."""

    detail = ""

    def __str__(self) -> str:
        return f"{int(self)} elements differ{self.detail}"


def mismatches(actual: torch.Tensor, expected: torch.Tensor) -> Mismatch:
    """How many elements differ bit for bit, counting any two NaNs as equal."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return Mismatch(max(actual.numel(), expected.numel(), 1))
    if not actual.dtype.is_floating_point:
        differ = actual != expected
    else:
        nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
        differ = ((_bits(actual) != _bits(expected)) & ~(nan_a & nan_e)) | (nan_a != nan_e)
    count = Mismatch(int(differ.sum()))
    if count:
        where = torch.nonzero(differ).flatten()[:3].tolist()
        size = actual.element_size()
        got, want = _bits(actual).cpu(), _bits(expected).cpu()
        hexa = lambda bits: f"{int(bits) & ((1 << 8 * size) - 1):0{2 * size}x}"  # noqa: E731
        count.detail = "; first at " + ", ".join(
            f"[{i}] got {actual[i].item()!r} ({hexa(got[i])}) expected {expected[i].item()!r} ({hexa(want[i])})"
            for i in where)
    return count


def make_values(kind: str, n: int, device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    if kind == "normal":
        values = torch.randn(n, generator=generator)
    elif kind == "ties":
        values = torch.randint(-4, 5, (n,), generator=generator).float() * 0.5
    elif kind == "special":
        values = torch.randn(n, generator=generator)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 7e4, -1e5, 65520.0, 3e38])
        positions = torch.randperm(n, generator=generator)[: min(n, 3 * len(specials))]
        values[positions] = specials[torch.arange(len(positions)) % len(specials)]
    else:
        raise ValueError(kind)
    return values.to(device)


def check_correctness(
    device, kernels: Dict[str, Callable], reference: Dict[str, Callable], sizes=(1, 17, 1000, 65536 + 7, 1 << 20)
) -> int:
    """Run ``kernels`` and ``reference`` (op name -> function) on the same inputs; the
    number of failed comparisons. Works on any device (the emulation reuses it on CPU)."""
    failures = 0
    for dtype_name, dtype in DTYPES.items():
        for n in sizes:
            for kind in ("normal", "ties", "special"):
                for mode in ("none", "separate", "aliased"):
                    seed = n + len(kind) + len(mode)
                    grad = make_values(kind, n, device, seed).to(dtype)
                    residual = None if mode == "none" else make_values("normal", n, device, seed + 1) * 0.75
                    start = make_values("special", n, device, seed + 2)
                    what = f"{dtype_name} n={n} {kind} residual={mode}"
                    compared = _compare_twobit(kernels, reference, grad, residual, mode, start, device)
                    for code in SCALED_CODES:
                        compared += _compare_scaled(kernels, reference, code, grad, residual, mode, start, device)
                    for k in sorted({1, max(1, n // 100), n}):  # top-k for k = 1, 1% and n
                        if k == n and n > 100_000:
                            continue  # the reference's int64 sort of everything is slow
                        compared += [(f"{name} k={k}", bad) for name, bad in
                                     _compare_topk(kernels, reference, grad, residual, mode, start, k, device)]
                    for name, bad in compared:
                        if bad:
                            failures += 1
                            print(f"  MISMATCH {name} {what}: {bad}")
        print(f"  {dtype_name}: checked; {failures} failures so far")
    return failures


def _outputs(residual, mode: str, n: int, device):
    """The kernel's residual input (a copy) and output (the input itself when aliased)."""
    residual_in = None if residual is None else residual.clone()
    return residual_in, residual_in if mode == "aliased" else torch.full((n,), 7.0, device=device)


def _compare_twobit(kernels, reference, grad, residual, mode: str, start, device):
    """``[(what, elements that differ)]`` of 2-bit's compression and decompression."""
    n = grad.numel()
    ref_codes = torch.empty((n + 15) // 16, dtype=torch.int32, device=device)
    ref_residual = torch.empty(n, device=device)
    reference["twobit_compress"](grad, residual, ref_residual, 0.5, ref_codes)
    codes = torch.full_like(ref_codes, -1)
    residual_in, residual_out = _outputs(residual, mode, n, device)
    kernels["twobit_compress"](grad, residual_in, residual_out, 0.5, codes)
    ref_out, out = start.clone(), start.clone()
    reference["twobit_decompress_add"](ref_codes, 0.5, ref_out)
    kernels["twobit_decompress_add"](codes, 0.5, out)
    return [("twobit_compress codes", mismatches(codes, ref_codes)),
            ("twobit_compress residual", mismatches(residual_out, ref_residual)),
            ("twobit_decompress_add", mismatches(out, ref_out))]


#: The codes with a scale per chunk: (op prefix, elements per int32 code word, elements per scale).
SCALED_CODES = (("twobit_chunk", 16, 64), ("threebit", 10, 128))


def _compare_scaled(kernels, reference, code, grad, residual, mode: str, start, device):
    """``[(what, elements that differ)]`` of a chunk-scaled code (:data:`SCALED_CODES`): 2-bit with a
    scale per 64 elements, 3-bit with a scale per 128."""
    prefix, per_word, chunk = code
    n = grad.numel()
    ref_codes = torch.empty(-(-n // per_word), dtype=torch.int32, device=device)
    ref_scales = torch.empty(-(-n // chunk), device=device)
    ref_residual = torch.empty(n, device=device)
    reference[f"{prefix}_compress"](grad, residual, ref_residual, ref_codes, ref_scales)
    codes, scales = torch.full_like(ref_codes, -1), torch.full_like(ref_scales, -1.0)
    residual_in, residual_out = _outputs(residual, mode, n, device)
    kernels[f"{prefix}_compress"](grad, residual_in, residual_out, codes, scales)
    ref_out, out = start.clone(), start.clone()
    reference[f"{prefix}_decompress_add"](ref_codes, ref_scales, ref_out)
    kernels[f"{prefix}_decompress_add"](codes, scales, out)
    return [(f"{prefix}_compress codes", mismatches(codes, ref_codes)),
            (f"{prefix}_compress scales", mismatches(scales, ref_scales)),
            (f"{prefix}_compress residual", mismatches(residual_out, ref_residual)),
            (f"{prefix}_decompress_add", mismatches(out, ref_out))]


def _compare_topk(kernels, reference, grad, residual, mode: str, start, k: int, device):
    """``[(what, elements that differ)]`` of top-k's compression (``k`` entries) and decompression."""
    n = grad.numel()
    ref_values = torch.empty(k, dtype=grad.dtype, device=device)
    ref_indices = torch.empty(k, dtype=torch.int32, device=device)
    ref_residual = torch.empty(n, device=device)
    # Every NaN ranks alike in the kernels (payloads are not portable); give the reference one
    # NaN payload so that it agrees.
    widened = torch.where(torch.isnan(grad), float("nan"), grad.float())
    reference["topk_compress"](widened, residual, ref_residual, ref_values, ref_indices)
    values = torch.zeros_like(ref_values)
    indices = torch.full_like(ref_indices, -1)
    residual_in, residual_out = _outputs(residual, mode, n, device)
    kernels["topk_compress"](grad, residual_in, residual_out, values, indices)
    ref_out, out = start.clone(), start.clone()
    reference["topk_decompress_add"](ref_values, ref_indices, ref_out)
    kernels["topk_decompress_add"](values, indices, out)
    return [("topk_compress indices", mismatches(indices, ref_indices)),
            ("topk_compress values", mismatches(values, ref_values)),
            ("topk_compress residual", mismatches(residual_out, ref_residual)),
            ("topk_decompress_add", mismatches(out, ref_out))]


def check_compressors(device, backend: str) -> int:
    """The compressors produce the same payloads (segment by segment, any NaN equal to any NaN:
    torch's CUDA casts encode a float16/bfloat16 NaN as 0x7FFF, its CPU casts and the kernels as
    0x7E00/0x7FC0) and residuals on ``backend`` and torch."""
    from gradcomp import TopK, TwoBit

    failures = 0
    for dtype in DTYPES.values():
        grad = make_values("special", 100_003, device, 11).to(dtype)
        for compressor in (TopK(0.01), TopK(1.0), TwoBit(0.5)):
            results = []
            for chosen in (backend, "torch"):
                residual = make_values("normal", grad.numel(), device, 12)
                payload = compressor.compress(grad, residual, residual, backend=chosen)
                out = torch.zeros(grad.numel(), device=device)
                compressor.decompress_add(payload, out, backend=chosen)
                segments = [payload[segment.name] for segment in payload.layout.segments]
                results.append((*segments, residual, out))
            bad = sum(mismatches(a, b) for a, b in zip(*results))
            if bad:
                failures += 1
                print(f"  MISMATCH {compressor!r} {dtype}: {bad} elements differ from the torch backend")
    return failures


def check_compact(device, backend: str) -> int:
    """Compact top-k's encode and check over a group's parts (:data:`gradcomp.backends.FORMS`' ``"sparse_parts"``): the
    forms of ``backend`` write the torch forms' payload bytes and residual, and read back their entries."""
    from gradcomp import TopK
    from gradcomp.compressors.per_parameter import PerParameter

    grouped = PerParameter(TopK(0.02, entries="compact"), (70_000, 3000, 65_536, 140_001))
    plan = grouped._plan(torch.float32)
    parts = grouped._on(plan.sparse, device)
    ks = [grouped.base.k(part.numel) for part in grouped.parts]
    generator = torch.Generator().manual_seed(3)
    indices = torch.cat([torch.randperm(part.numel, generator=generator)[:k].sort().values
                         for part, k in zip(grouped.parts, ks)]).to(torch.int32).to(device)
    values = make_values("normal", sum(ks), device, 13)
    results = []
    for chosen in (backend, "torch"):
        buffer = plan.whole.allocate(device).buffer.zero_()
        residual = make_values("normal", grouped.numel, device, 14)
        parts.encode(values, indices, buffer, residual, chosen)
        positions, read = parts.entries(buffer, torch.float32, chosen)
        results.append((buffer, residual, positions, read.float()))
    bad = sum(mismatches(a, b) for a, b in zip(*results))
    if bad:
        print(f"  MISMATCH compact top-k encode/check: {bad} elements differ from the torch forms")
    return int(bad > 0)


# --- timing -----------------------------------------------------------------------


def time_gpu(fn: Callable[[], None], repeats: int, warmup: int = 3) -> float:
    """Median seconds per call, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def copy_bandwidth(device, nbytes: int, repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / time_gpu(lambda: dst.copy_(src), repeats)


def benchmark(device, kernels, reference, sizes: List[int], density: float, repeats: int) -> None:
    copy_bps = copy_bandwidth(device, 256 << 20, repeats)
    print(f"\ndevice-to-device copy: {copy_bps / 1e9:.0f} GB/s (256 MiB, read + write)\n")
    header = f"{'op':<22}{'dtype':<6}{'n':>10}{'cuda us':>10}{'torch us':>11}{'speedup':>9}{'GB/s':>8}{'% copy':>8}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        k = max(1, math.ceil(density * n))
        for dtype_name, dtype in DTYPES.items():
            g = torch.tensor([], dtype=dtype).element_size()
            grad = torch.randn(n, device=device).to(dtype)
            residual = torch.randn(n, device=device) * 0.1
            codes = torch.empty((n + 15) // 16, dtype=torch.int32, device=device)
            scales = torch.empty((n + 63) // 64, device=device)
            codes3 = torch.empty(-(-n // 10), dtype=torch.int32, device=device)
            scales3 = torch.empty(-(-n // 128), device=device)
            values = torch.empty(k, dtype=dtype, device=device)
            indices = torch.empty(k, dtype=torch.int32, device=device)
            out = torch.zeros(n, device=device)
            reference["topk_compress"](grad, residual.clone(), None, values, indices)
            # The least traffic each op needs: everything read once, everything written once.
            cases = {
                "twobit_compress": (lambda ops: ops["twobit_compress"](grad, residual, residual, 0.5, codes),
                                    n * (g + 8) + 4 * codes.numel()),
                "twobit_decompress_add": (lambda ops: ops["twobit_decompress_add"](codes, 0.5, out),
                                          4 * codes.numel() + 8 * n),
                "twobit_chunk_compress": (
                    lambda ops: ops["twobit_chunk_compress"](grad, residual, residual, codes, scales),
                    n * (g + 8) + 4 * codes.numel() + 4 * scales.numel()),
                "twobit_chunk_decompress_add": (lambda ops: ops["twobit_chunk_decompress_add"](codes, scales, out),
                                                4 * codes.numel() + 4 * scales.numel() + 8 * n),
                "threebit_compress": (
                    lambda ops: ops["threebit_compress"](grad, residual, residual, codes3, scales3),
                    n * (g + 8) + 4 * codes3.numel() + 4 * scales3.numel()),
                "threebit_decompress_add": (lambda ops: ops["threebit_decompress_add"](codes3, scales3, out),
                                            4 * codes3.numel() + 4 * scales3.numel() + 8 * n),
                "topk_compress": (lambda ops: ops["topk_compress"](grad, residual, residual, values, indices),
                                  n * (g + 8) + k * (g + 4)),
                "topk_decompress_add": (lambda ops: ops["topk_decompress_add"](values, indices, out),
                                        k * (g + 4 + 8)),
            }
            for op, (call, nbytes) in cases.items():
                if op.endswith("decompress_add") and not op.startswith("topk") and dtype_name != "f32":
                    continue  # dtype-independent
                cuda_s = time_gpu(lambda: call(kernels), repeats)
                torch_s = time_gpu(lambda: call(reference), repeats)
                gbps = nbytes / cuda_s / 1e9
                print(
                    f"{op:<22}{dtype_name:<6}{n:>10}{cuda_s * 1e6:>10.1f}{torch_s * 1e6:>11.1f}"
                    f"{torch_s / cuda_s:>8.1f}x{gbps:>8.0f}{100 * gbps * 1e9 / copy_bps:>7.0f}%"
                )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="65536,1048576,16777216,67108864",
                        help="comma-separated element counts to time")
    parser.add_argument("--density", type=float, default=0.01, help="top-k: fraction of entries kept")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--skip-timing", action="store_true", help="only check correctness")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_selfcheck: no CUDA GPU visible to torch (torch.cuda.is_available() is False); "
              "nothing to check. The kernels are tested on CPU by tests/test_cuda_kernels.py.")
        return 2
    try:
        from gradcomp.backends import cuda_ops
    except ImportError as error:
        print(f"gpu_selfcheck: the cuda backend cannot be imported ({error}); pip install cupy-cuda12x")
        return 2
    from gradcomp.backends import torch_ops

    device = torch.device("cuda", torch.cuda.current_device())
    try:
        cuda_ops.device_launcher(device.index)
    except RuntimeError as error:
        print(f"gpu_selfcheck: {error}")
        return 2
    print(f"gpu_selfcheck on {torch.cuda.get_device_name(device)} "
          f"(torch {torch.__version__}, launch config {cuda_ops.device_config(device.index)})")

    kernels = {op: getattr(cuda_ops, op) for op in OPS}
    reference = {op: getattr(torch_ops, op) for op in OPS}
    print("correctness against the torch reference:")
    failures = check_correctness(device, kernels, reference)
    failures += check_compressors(device, "cuda")
    failures += check_compact(device, "cuda")
    torch.cuda.synchronize()
    print("correctness: " + ("all match" if failures == 0 else f"{failures} MISMATCHES"))

    if not args.skip_timing:
        sizes = [int(size) for size in args.sizes.split(",") if size]
        benchmark(device, kernels, reference, sizes, args.density, args.repeats)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
