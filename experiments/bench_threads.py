"""The Numba kernels beside other ranks on one machine: what a launch costs when every rank's OpenMP team
is as large as the machine.

Starts ``--procs`` processes at once (2: two ranks on this machine's two cores), each with torch at one
thread (as ``torchrun`` sets ``OMP_NUM_THREADS=1``) and Numba at ``--numba-threads`` (``default``: what
Numba allows, one per core, unless ``$NUMBA_NUM_THREADS`` says otherwise), and times a loop of four
256 x 256 matmuls and 20 launches of the 3-bit compression of 30,000 floats (a bucket's parameters, one
launch each). ``--cap`` runs the ops as gradcomp does (at most torch's threads,
:mod:`gradcomp.backends.numba.concurrency`); ``--no-cap`` with Numba's own setting, as before. Run it
alone on the machine::

    ../shared/tools/quiet python -m experiments.bench_threads --no-cap
    ../shared/tools/quiet python -m experiments.bench_threads --cap

Prints each process's median loop time (ms) over ``--loops`` loops (the first 10 not counted), the
settings and the load average before the run.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

__all__ = ["main"]


def _loop_times(cap: bool, loops: int, queue) -> None:
    """One process's median loop seconds, put on ``queue`` with the Numba threads its kernels ran on."""
    import torch

    torch.set_num_threads(1)
    import numba

    from gradcomp.compressors.threebit import ThreeBit

    if not cap:  # as before the cap: every launch on Numba's whole pool (the ops' wrapper reads torch's count)
        pool = numba.config.NUMBA_NUM_THREADS
        torch.get_num_threads = lambda: pool
    compressor, matrix = ThreeBit(), torch.randn(256, 256)
    pieces = [torch.randn(30_000) for _ in range(20)]
    residual, residual_out = torch.zeros(30_000), torch.zeros(30_000)
    seconds = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(4):
            matrix @ matrix
        for piece in pieces:
            compressor.compress(piece, residual, residual_out, backend="numba")
        seconds.append(time.perf_counter() - start)
    queue.put((statistics.median(seconds[10:]), numba.get_num_threads()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench_threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--loops", type=int, default=60)
    parser.add_argument("--numba-threads", default="default", help="NUMBA_NUM_THREADS for the processes")
    parser.add_argument("--cap", action=argparse.BooleanOptionalAction, default=True,
                        help="cap the kernels' threads at torch's, as gradcomp does (default)")
    args = parser.parse_args(argv)
    if args.numba_threads != "default":
        os.environ["NUMBA_NUM_THREADS"] = args.numba_threads
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_loop_times, args=(args.cap, args.loops, queue)) for _ in range(args.procs)]
    load = os.environ.get("QUIET_LOAD_BEFORE", f"{os.getloadavg()[0]:.2f}")
    for process in processes:
        process.start()
    results = [queue.get(timeout=600) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    print(f"procs {args.procs}, cap {args.cap}, NUMBA_NUM_THREADS {os.environ.get('NUMBA_NUM_THREADS', 'default')}, "
          f"load before {load}")
    for index, (seconds, threads) in enumerate(results):
        print(f"  process {index}: median loop {seconds * 1e3:.2f} ms, Numba threads {threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
