"""Benchmark every kernel op on every available backend: time, GB/s and % of the floor.

For each size ``n``, gradient dtype, input distribution and (for top-k) density, every op
runs on every available backend: the fused compress with error feedback (residual read
and updated in place, as :class:`gradcomp.error_feedback.ErrorFeedback` does) and the matching
decompress-add. Each timing is the median of ``--repeats`` runs after a warm-up; the
inputs (the residual) are restored before every run, outside the timed region.

**Floor.** The floor of an op is the time it would take at the machine's copy bandwidth:
``floor = bytes that must move / copy bandwidth``. The copy bandwidth is measured in the
same run, at the same ``n`` (so both sit in the same level of the memory hierarchy), as
the median time of ``dst.copy_(src)`` on float32 tensors, counting the bytes read plus
the bytes written (``8 n``). ``floor_pct = 100 * floor / median time``: 100 % means the
op moves its bytes as fast as a copy does.

Bytes that must move, with ``g`` the gradient element size (4 for float32, 2 for
bfloat16), ``k = max(1, ceil(density * n))`` and ``x`` the index size (4):

=========================  ==================================================
op                         bytes
=========================  ==================================================
``twobit_compress``        ``n * (g + 4 + 4) + 4 * ceil(n / 16)``
                           (grad, residual in, residual out, codes)
``twobit_decompress_add``  ``4 * ceil(n / 16) + 8 * n`` (codes, out read and written)
``twobit_chunk_compress``  ``twobit_compress``'s + ``4 * ceil(n / 64)`` (the scales)
``twobit_chunk_decompress_add``  ``twobit_decompress_add``'s + ``4 * ceil(n / 64)``
``threebit_compress``      ``n * (g + 4 + 4) + 4 * ceil(n / 10) + 4 * ceil(n / 128)``
``threebit_decompress_add``  ``4 * ceil(n / 10) + 4 * ceil(n / 128) + 8 * n``
``topk_compress``          ``n * (g + 4 + 4) + k * (g + x)``
                           (grad, residual in, residual out, values, indices)
``topk_decompress_add``    ``k * (g + x) + 8 * k`` (payload; the k entries of out
                           read and written: an optimistic count for a scatter)
=========================  ==================================================

``speedup_vs_torch`` is the torch reference's median time for the same op, size, dtype,
distribution and density on the same device, divided by this backend's (None when the
reference was skipped, see ``--torch-max-size``).

Examples::

    python experiments/bench_kernels.py --sizes 1048576 --repeats 3
    python experiments/bench_kernels.py --sizes 2^24 --dtypes float32 --densities 0.01 --json out/bench.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from gradcomp.backends import BACKENDS, KERNELS, OPS, is_available

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DISTS = ("gaussian", "student_t2")
THRESHOLD = 0.5  # 2-bit threshold, in units of the gradients' scale
INDEX_BYTES = 4


def parse_size(text: str) -> int:
    """``1048576``, ``2^20`` or ``2**20``."""
    text = text.replace("**", "^")
    if "^" in text:
        base, exponent = text.split("^")
        return int(base) ** int(exponent)
    return int(text)


def sample(dist: str, n: int, generator: torch.Generator) -> torch.Tensor:
    if dist == "gaussian":
        return torch.randn(n, generator=generator)
    if dist == "student_t2":  # z / sqrt(chi2_2 / 2), and chi2_2 / 2 ~ Exp(1)
        return torch.randn(n, generator=generator) / torch.empty(n).exponential_(generator=generator).sqrt_()
    raise ValueError(f"unknown distribution {dist!r}; choose from {DISTS}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(run: Callable[[], None], prepare: Callable[[], None], device, repeats: int, warmup: int):
    """Median and min wall time of ``run`` over ``repeats`` calls after ``warmup`` calls;
    ``prepare`` runs before each call, untimed."""
    times = []
    for i in range(warmup + repeats):
        prepare()
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def copy_bandwidth(n: int, device, repeats: int, warmup: int) -> float:
    """Bytes per second of ``dst.copy_(src)`` on float32 ``[n]``, read + write."""
    src = torch.ones(n, device=device)
    dst = torch.empty(n, device=device)
    median, _ = median_time(lambda: dst.copy_(src), lambda: None, device, repeats, warmup)
    return 8 * n / median


def op_bytes(op: str, n: int, k: Optional[int], grad_bytes: int) -> int:
    words = 4 * ((n + 15) // 16)
    if op == "twobit_compress":
        return n * (grad_bytes + 8) + words
    if op == "twobit_decompress_add":
        return words + 8 * n
    if op == "twobit_chunk_compress":
        return n * (grad_bytes + 8) + words + 4 * ((n + 63) // 64)
    if op == "twobit_chunk_decompress_add":
        return words + 4 * ((n + 63) // 64) + 8 * n
    if op == "threebit_compress":
        return n * (grad_bytes + 8) + 4 * -(-n // 10) + 4 * -(-n // 128)
    if op == "threebit_decompress_add":
        return 4 * -(-n // 10) + 4 * -(-n // 128) + 8 * n
    if op == "topk_compress":
        return n * (grad_bytes + 8) + k * (grad_bytes + INDEX_BYTES)
    if op == "topk_decompress_add":
        return k * (grad_bytes + INDEX_BYTES) + 8 * k
    raise ValueError(op)


def devices_for(backend: str) -> List[torch.device]:
    """Devices on which ``backend`` runs here (the torch reference runs on all of them)."""
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found.append(torch.device("cuda"))
    return [d for d in found if is_available(backend, d)]


def bench_case(backend, device, op, n, dtype, dist, density, args, generator) -> Dict:
    """Time one (op, backend, n, dtype, dist, density) and return its record (without the
    floor and speed-up, which the caller adds)."""
    base = sample(dist, n, generator).to(device)
    grad = base.to(dtype)
    residual_start = (0.1 * torch.randn(n, generator=generator)).to(device)
    residual = residual_start.clone()
    restore = lambda: residual.copy_(residual_start)  # noqa: E731
    compress = KERNELS[(op.replace("decompress_add", "compress"), backend)]
    k = None
    if op.startswith(("twobit_chunk", "threebit")):
        prefix, per_word, chunk = ("twobit_chunk", 16, 64) if op.startswith("twobit") else ("threebit", 10, 128)
        codes = torch.empty(-(-n // per_word), dtype=torch.int32, device=device)
        scales = torch.empty(-(-n // chunk), device=device)
        compress_call = lambda: compress(grad, residual, residual, codes, scales)  # noqa: E731
        out = torch.zeros(n, device=device)
        decompress = KERNELS[(f"{prefix}_decompress_add", backend)]
        decompress_call = lambda: decompress(codes, scales, out)  # noqa: E731
    elif op.startswith("twobit"):
        codes = torch.empty((n + 15) // 16, dtype=torch.int32, device=device)
        compress_call = lambda: compress(grad, residual, residual, THRESHOLD, codes)  # noqa: E731
        out = torch.zeros(n, device=device)
        decompress = KERNELS[("twobit_decompress_add", backend)]
        decompress_call = lambda: decompress(codes, THRESHOLD, out)  # noqa: E731
    else:
        k = max(1, math.ceil(density * n))
        values = torch.empty(k, dtype=dtype, device=device)
        indices = torch.empty(k, dtype=torch.int32, device=device)
        compress_call = lambda: compress(grad, residual, residual, values, indices)  # noqa: E731
        out = torch.zeros(n, device=device)
        decompress = KERNELS[("topk_decompress_add", backend)]
        decompress_call = lambda: decompress(values, indices, out)  # noqa: E731
    if op.endswith("_compress"):
        median, fastest = median_time(compress_call, restore, device, args.repeats, args.warmup)
    else:
        restore()
        compress_call()  # a payload to decode
        median, fastest = median_time(decompress_call, lambda: None, device, args.repeats, args.warmup)
    nbytes = op_bytes(op, n, k, grad.element_size())
    return {
        "op": op, "backend": backend, "device": device.type, "n": n, "dtype": str(dtype).replace("torch.", ""),
        "density": density, "k": k, "dist": dist, "median_s": median, "min_s": fastest, "bytes": nbytes,
        "gbps": nbytes / median / 1e9, "threads": args.threads, "repeats": args.repeats,
    }


HEADER = (f"{'op':24s} {'backend':7s} {'dtype':9s} {'dist':10s} {'density':>7s} {'median ms':>10s} "
          f"{'GB/s':>7s} {'floor%':>7s} {'speedup':>8s}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", type=parse_size, default=[2**20, 2**22, 2**24, 2**26],
                        help="element counts, e.g. 1048576 or 2^24 (default: 2^20 2^22 2^24 2^26)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--densities", nargs="+", type=float, default=[0.001, 0.01, 0.1],
                        help="top-k densities k/n (default: 0.001 0.01 0.1)")
    parser.add_argument("--dists", nargs="+", choices=DISTS, default=list(DISTS))
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=None,
                        help="default: every available backend; the torch reference always runs too, for the speed-ups")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=None,
                        help="only these device types (default: every device a chosen backend runs on)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per case; the median is reported")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first (numba compiles on its first call)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch and numba threads (default: all cores)")
    parser.add_argument("--torch-max-size", type=parse_size, default=None,
                        help="skip the torch reference above this n (its top-k takes seconds at 2^26); "
                             "speed-ups are then None")
    parser.add_argument("--json", default=None, help="write the records here, as a JSON list")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def set_threads(threads: int, backends) -> None:
    torch.set_num_threads(threads)
    if "numba" in backends:
        import numba

        allowed = numba.config.NUMBA_NUM_THREADS
        if threads > allowed:
            print(f"note: numba allows {allowed} threads ($NUMBA_NUM_THREADS), not {threads}")
        numba.set_num_threads(min(threads, allowed))


def cases(args):
    """``(dtype name, dist, op, density)`` for every case of one size."""
    for dtype_name, dist, op in itertools.product(args.dtypes, args.dists, args.ops):
        for density in [None] if not op.startswith("topk") else args.densities:
            yield dtype_name, dist, op, density


def format_record(r: Dict) -> str:
    density = "-" if r["density"] is None else f"{r['density']:g}"
    speedup = "-" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.1f}x"
    return (f"{r['op']:24s} {r['backend']:7s} {r['dtype']:9s} {r['dist']:10s} {density:>7s} "
            f"{r['median_s'] * 1e3:10.3f} {r['gbps']:7.1f} {r['floor_pct']:7.1f} {speedup:>8s}")


def main(argv=None) -> List[Dict]:
    args = parse_args(argv)
    # The torch reference always runs first: it gives the speed-ups.
    chosen = args.backends or [b for b in BACKENDS if devices_for(b)]
    backends = ["torch"] + [b for b in chosen if b != "torch"]
    set_threads(args.threads, backends)
    try:
        load = "load average %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "load average unknown"
    print(f"threads={args.threads} repeats={args.repeats} {load} backends={backends}")

    records: List[Dict] = []
    generator = torch.Generator().manual_seed(args.seed)
    devices = sorted({d for b in backends for d in devices_for(b) if args.devices in (None, [])
                      or d.type in args.devices}, key=str)
    for n, device in itertools.product(args.sizes, devices):
        bandwidth = copy_bandwidth(n, device, max(args.repeats, 5), args.warmup)
        print(f"\nn={n} ({n * 4 / 2**20:.0f} MiB fp32) on {device}: copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        print(HEADER)
        for dtype_name, dist, op, density in cases(args):
            reference = None
            for backend in backends:
                skipped = backend == "torch" and args.torch_max_size is not None and n > args.torch_max_size
                if skipped or device not in devices_for(backend):
                    continue
                record = bench_case(backend, device, op, n, DTYPES[dtype_name], dist, density, args, generator)
                record["copy_gbps"] = bandwidth / 1e9
                record["floor_pct"] = 100.0 * record["bytes"] / bandwidth / record["median_s"]
                if backend == "torch":
                    reference = record["median_s"]
                record["speedup_vs_torch"] = reference / record["median_s"] if reference else None
                records.append(record)
                print(format_record(record), flush=True)
    print_ratios(records)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)
        print(f"\nwrote {len(records)} records to {args.json}")
    return records


def print_ratios(records: List[Dict]) -> None:
    """Top-k compress time over 2-bit compress time, measured side by side."""
    twobit = {(r["backend"], r["device"], r["n"], r["dtype"], r["dist"]): r["median_s"]
              for r in records if r["op"] == "twobit_compress"}
    lines = []
    for r in records:
        key = (r["backend"], r["device"], r["n"], r["dtype"], r["dist"])
        if r["op"] == "topk_compress" and key in twobit:
            lines.append(f"{r['backend']:7s} {r['device']:4s} n={r['n']:<10d} {r['dtype']:9s} {r['dist']:10s} "
                         f"density={r['density']:<6g} topk/2bit = {r['median_s'] / twobit[key]:.2f}")
    if lines:
        print("\ntop-k compress time / 2-bit compress time (both with error feedback):")
        print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
