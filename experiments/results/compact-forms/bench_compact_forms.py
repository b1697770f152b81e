"""Interleaved medians on charlm-small's parameters (a 2 % compact selection): compact top-k's encode and check,
the torch form against the numba form (gradcomp/backends/numba/compact.py); index_put_(accumulate=True) against
index_add_.

Usage, from the repository root: ``../shared/tools/quiet env PYTHONPATH=. python
experiments/results/compact-forms/bench_compact_forms.py``.
"""
import statistics
import time

import torch

from experiments import suite
from gradcomp.compressors import TopK
from gradcomp.compressors.per_parameter import PerParameter

ROUNDS = 200


def main() -> None:
    torch.set_num_threads(1)
    numels = [p.numel() for p in suite.build("charlm-small", 0).build_model().parameters()]
    grouped = PerParameter(TopK(0.02, entries="compact"), numels, dense_below=1024)
    n = sum(numels)
    parts = grouped._plan(torch.float32).sparse["cpu"]
    payload = grouped.compress(torch.randn(n), torch.randn(n) * 0.1, torch.empty(n))
    kept = [part for part in grouped.parts if not part.dense]
    ks = [grouped.base.k(part.numel) for part in kept]
    values = torch.randn(sum(ks))
    indices = torch.cat([torch.randperm(part.numel)[:k].sort().values.int() for part, k in zip(kept, ks)])
    positions = indices.long() + torch.cat([torch.full((k,), part.offset) for part, k in zip(kept, ks)])
    diff, buffer, residual = torch.randn(sum(ks)), payload.buffer.clone(), torch.randn(n)
    cases = {
        "encode torch": lambda: parts.encode(values, indices, buffer, residual, "torch"),
        "encode numba": lambda: parts.encode(values, indices, buffer, residual, "numba"),
        "check torch": lambda: parts.entries(payload.buffer, torch.float32, "torch"),
        "check numba": lambda: parts.entries(payload.buffer, torch.float32, "numba"),
        "index_put_": lambda: residual.index_put_((positions,), diff, accumulate=True),
        "index_add_": lambda: residual.index_add_(0, positions, diff),
    }
    for call in cases.values():
        for _ in range(5):  # warm-up (Numba compiles on first use)
            call()
    times = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, call in cases.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    print(f"{sum(ks)} entries, {len(kept)} parts, medians of {ROUNDS} interleaved calls, one thread")
    for name, taken in times.items():
        print(f"{name:14s} {statistics.median(taken) * 1e6:7.0f} us")


if __name__ == "__main__":
    main()
