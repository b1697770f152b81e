"""Per-parameter compression against one whole tensor: what compressing a DDP bucket parameter by
parameter costs.

A bucket of ``n`` elements holding ``--params`` parameters of mixed sizes (log-uniform between
2^8 and 2^19 elements, the last one taking the rest, so every size class of a real model is
there) is compressed with :class:`gradcomp.compressors.per_parameter.PerParameter` (error
feedback on, parameters under ``min_numel`` = 1024 sent dense, as the engine does), and the same
``n`` elements as one tensor with the base compressor. The two run interleaved (A B A B ...), so
both see the same machine state; each figure is the median of ``--repeats`` and the ratio of
the medians is printed with the spread of the per-round ratios.

Example::

    ../shared/tools/quiet python -m experiments.bench_per_parameter --size 2^24 --backend numba
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch

from experiments.bench_kernels import parse_size, set_threads
from gradcomp.compressors import from_spec
from gradcomp.compressors.per_parameter import PerParameter

MIN_NUMEL = 1024


def mixed_sizes(total: int, count: int, seed: int = 0) -> list:
    """``count`` parameter sizes summing to ``total``: log-uniform in [2^8, 2^19], the last the rest."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(2**8), np.log(2**19), count - 1)).astype(np.int64)
    sizes = np.minimum(sizes, max(1, (total - count) // count * 2))
    rest = total - int(sizes.sum())
    if rest < 1:
        raise ValueError(f"{count} parameters do not fit in {total} elements")
    return [int(s) for s in sizes] + [rest]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=2**24, help="elements in the bucket (default 2^24)")
    parser.add_argument("--params", type=int, default=100, help="parameters in the bucket (default 100)")
    parser.add_argument("--specs", nargs="+", default=["topk:0.01", "twobit:rms"])
    parser.add_argument("--backend", default="numba")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    set_threads(args.threads, [args.backend])
    sizes = mixed_sizes(args.size, args.params)
    load = os.getloadavg()[0]
    print(f"n={args.size} in {len(sizes)} parameters (smallest {min(sizes)}, largest {max(sizes)}), "
          f"backend={args.backend}, threads={args.threads}, load average {load:.2f}")
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(args.size, generator=generator)
    residual = torch.randn(args.size, generator=generator) * 0.1
    results = {"size": args.size, "params": len(sizes), "backend": args.backend, "threads": args.threads,
               "load_before": load, "cases": []}
    for spec in args.specs:
        base = from_spec(spec)
        grouped = PerParameter(base, sizes, dense_below=MIN_NUMEL)
        runs = {"whole": lambda: base.compress(grad, residual, torch.empty_like(residual), backend=args.backend),
                "per_parameter": lambda: grouped.compress(grad, residual, torch.empty_like(residual),
                                                          backend=args.backend)}
        for run in runs.values():  # compile and warm up outside the timed rounds
            run()
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        ratios = [p / w for p, w in zip(times["per_parameter"], times["whole"])]
        case = {"spec": spec, "whole_s": statistics.median(times["whole"]),
                "per_parameter_s": statistics.median(times["per_parameter"])}
        case["ratio"] = case["per_parameter_s"] / case["whole_s"]
        case["ratio_min"], case["ratio_max"] = min(ratios), max(ratios)
        results["cases"].append(case)
        print(f"{spec:12s} whole {case['whole_s'] * 1e3:8.2f} ms  per-parameter {case['per_parameter_s'] * 1e3:8.2f} ms"
              f"  ratio {case['ratio']:.2f} (rounds {case['ratio_min']:.2f}-{case['ratio_max']:.2f})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return results


if __name__ == "__main__":
    main()
