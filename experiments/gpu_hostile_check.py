"""What a hostile peer could send, fed to the cuda backend's decoders on a real GPU.

``tests/test_hostile_payloads.py`` runs these cases on the torch and numba backends and on the
CUDA kernels in the CPU emulation; this runs them on the device, where an out-of-bounds write
would land in GPU memory. Each decoder's output is the middle of a larger buffer; a case passes
when the decoder raises ``ValueError`` saying nothing was written (or, for a valid payload,
decodes it) and the buffer around the output, and for a rejected payload the output too, is
bitwise unchanged. Run it under ``compute-sanitizer --tool memcheck`` to have every access checked.

Usage::

    python -m experiments.gpu_hostile_check [--device cpu --backend numba]
    compute-sanitizer --tool memcheck --error-exitcode 9 python -m experiments.gpu_hostile_check

Exit status: 0 when every case passes, 1 otherwise, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

import torch

N = 100
GUARD = 64
KINDS = ("equal_to_n", "far_past_n", "int_max", "minus_one", "minus_n", "int_min", "duplicate",
         "duplicate_unsorted", "unsorted", "all_same")


def hostile_indices(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """Ten top-k indices into ``N`` elements, spoiled as ``kind`` says."""
    indices = torch.tensor([0, 3, 9, 27, 40, 41, 63, 88, 98, 99])
    if kind == "equal_to_n":
        indices[-1] = N
    elif kind == "far_past_n":
        indices[4] = 10**6
    elif kind == "int_max":
        indices[-1] = torch.iinfo(dtype).max
    elif kind == "minus_one":
        indices[0] = -1
    elif kind == "minus_n":
        indices[0] = -N
    elif kind == "int_min":
        indices[2] = torch.iinfo(dtype).min
    elif kind == "duplicate":
        indices[5] = indices[4]
    elif kind == "duplicate_unsorted":
        indices[3], indices[4], indices[5] = 40, 27, 40
    elif kind == "unsorted":
        indices = indices.flip(0)
    elif kind == "all_same":
        indices[:] = 7
    return indices.to(dtype)


def case(device, what: str, decode: Callable[[torch.Tensor], None], rejected: bool) -> Optional[str]:
    """Run ``decode(out)`` on a guarded output; ``None`` when it behaved, else what went wrong."""
    buffer = torch.randn(N + 2 * GUARD, generator=torch.Generator().manual_seed(len(what))).to(device)
    before = buffer.clone()
    out = buffer[GUARD: GUARD + N]
    try:
        decode(out)
        outcome = "accepted" if rejected else None
    except (ValueError, TypeError) as error:  # the wrappers' size checks and the decoders' index check
        outcome = None if rejected else f"rejected ({error})"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if not torch.equal(buffer[:GUARD].view(torch.int32), before[:GUARD].view(torch.int32)) or \
            not torch.equal(buffer[-GUARD:].view(torch.int32), before[-GUARD:].view(torch.int32)):
        return f"{what}: written outside the output"
    if rejected and not torch.equal(buffer.view(torch.int32), before.view(torch.int32)):
        return f"{what}: rejected, but the output changed"
    return None if outcome is None else f"{what}: {outcome}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cpu with --backend numba: the same cases without a GPU")
    parser.add_argument("--backend", default="cuda")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hostile_check: no CUDA GPU visible to torch; tests/test_hostile_payloads.py runs these cases on CPU")
        return 2
    from gradcomp.backends import kernel

    device = torch.device(args.device)
    topk = kernel("topk_decompress_add", device, args.backend)
    twobit = kernel("twobit_decompress_add", device, args.backend)
    chunk = kernel("twobit_chunk_decompress_add", device, args.backend)
    failures, cases = [], 0

    def check(what, decode, rejected):
        nonlocal cases
        cases += 1
        problem = case(device, what, decode, rejected)
        if problem:
            failures.append(problem)

    valid = torch.tensor([0, 3, 9, 27, 40, 41, 63, 88, 98, 99])
    for value_dtype in (torch.float32, torch.float16, torch.bfloat16):
        values = torch.arange(1, 11, dtype=value_dtype, device=device)
        for index_dtype in (torch.int32, torch.int64):
            for kind in KINDS:
                indices = hostile_indices(kind, index_dtype).to(device)
                check(f"top-k {kind} {value_dtype} {index_dtype}", lambda out: topk(values, indices, out), True)
            check(f"top-k valid {value_dtype} {index_dtype}",
                  lambda out: topk(values, valid.to(index_dtype).to(device), out), False)
        check(f"top-k more values than indices {value_dtype}",
              lambda out: topk(torch.ones(11, dtype=value_dtype, device=device), valid.to(device).int(), out), True)
    words = (N + 15) // 16
    for count in (0, words - 1, words + 1, 100):
        codes = torch.full((count,), -1, dtype=torch.int32, device=device)
        check(f"2-bit {count} code words", lambda out: twobit(codes, 0.5, out), True)
        scales = torch.ones((N + 63) // 64, device=device)
        check(f"chunk 2-bit {count} code words", lambda out: chunk(codes, scales, out), True)
    codes = torch.full((words,), -1, dtype=torch.int32, device=device)  # garbage in the last word's padding
    check("2-bit padding bits set", lambda out: twobit(codes, 0.5, out), False)
    for count in (0, 1, 3):
        scales = torch.ones(count, device=device)
        check(f"chunk 2-bit {count} scales", lambda out: chunk(codes, scales, out), True)
    check("chunk 2-bit padding bits set", lambda out: chunk(codes, torch.ones(2, device=device), out), False)
    threebit = kernel("threebit_decompress_add", device, args.backend)
    words3, chunks3 = -(-N // 10), -(-N // 128)
    for count in (0, words3 - 1, words3 + 1, 100):
        codes = torch.full((count,), -1, dtype=torch.int32, device=device)
        check(f"3-bit {count} code words", lambda out: threebit(codes, torch.ones(chunks3, device=device), out), True)
    codes = torch.full((words3,), -1, dtype=torch.int32, device=device)  # every spare bit set: never read
    for count in (0, chunks3 + 1):
        check(f"3-bit {count} scales", lambda out: threebit(codes, torch.ones(count, device=device), out), True)
    check("3-bit spare bits set", lambda out: threebit(codes, torch.ones(chunks3, device=device), out), False)
    for problem in failures:
        print("  FAIL", problem)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device} ({args.backend})"
    print(f"gpu_hostile_check on {where}: {cases - len(failures)} of {cases} cases behaved")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
