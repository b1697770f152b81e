"""``experiments.noise_floor`` with each process pinned to its own core (``PIN=1``) or not (``PIN=0``); informal probe.

From the repository root: ``PIN=1 PYTHONPATH=. python3 experiments/results/noise-floor/pinned.py --procs 2
--round-seconds 2 --rounds 6 --width 512``. Prints each process's round medians and their spread.
"""
import multiprocessing as mp
import os
import sys
import time

from experiments import noise_floor
from experiments.step_times import spread


def pinned(proc, args, start_at, queue):
    if os.environ.get("PIN") == "1":
        os.sched_setaffinity(0, {proc % os.cpu_count()})
    noise_floor._time_rounds(proc, args, start_at, queue)


if __name__ == "__main__":
    args = noise_floor.parse_args(sys.argv[1:])
    context = mp.get_context("spawn")
    queue = context.Queue()
    start_at = time.monotonic() + 5.0
    procs = [context.Process(target=pinned, args=(p, args, start_at, queue)) for p in range(args.procs)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    for proc, medians, counts in results:
        print(f"PIN={os.environ.get('PIN')} proc {proc}: spread {spread(medians):.1%} medians(ms) "
              + " ".join(f"{m*1e3:.3f}" for m in medians))
