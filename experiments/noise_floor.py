"""The machine's own step-time noise: a fixed compute step timed in rounds, with no communication.

What a step-time figure can resolve is bounded by how much the machine's speed itself drifts
between rounds. This times one fixed step (a forward and backward pass of an MLP of ``--width``
on a batch of 64, one thread, no communication) in ``--rounds`` rounds of ``--round-seconds`` each,
in ``--procs`` processes at once (2: as the step-time benchmark's two ranks share this machine's two
cores; ``--pin``: each on a core of its own), and prints each process's per-round medians and their ``spread``
(the range of the round medians over their median, as ``experiments.step_times`` computes it). Run it alone::

    ../shared/tools/quiet python -m experiments.noise_floor --procs 2 --round-seconds 2

Output (``--out``, optional): a JSON list, one row per process ``{proc, round_seconds, rounds:
[median step seconds per round], spread, steps_per_round, cores (the process's CPU affinity), load_before}``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

from experiments.step_times import spread

__all__ = ["main", "spread"]


def _time_rounds(proc: int, args, start_at: float, queue) -> None:
    """Times the fixed step in rounds; puts ``(proc, [round medians], [steps per round], [its cores])`` on ``queue``."""
    import torch

    if args.pin:  # each process on its own core: whether the two trading cores is what moves the rounds
        allowed = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {allowed[proc % len(allowed)]})
    torch.set_num_threads(1)
    torch.manual_seed(proc)
    net = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                              torch.nn.Linear(args.width, args.width))
    batch = torch.randn(64, args.width)
    for _ in range(20):  # warm the allocator and the kernels before the first round
        net(batch).square().mean().backward()
    while time.monotonic() < start_at:  # both processes start their rounds together
        time.sleep(0.001)
    medians, counts = [], []
    for _ in range(args.rounds):
        times, end = [], time.perf_counter() + args.round_seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            net.zero_grad(set_to_none=True)
            net(batch).square().mean().backward()
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
        counts.append(len(times))
    queue.put((proc, medians, counts, sorted(os.sched_getaffinity(0))))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--round-seconds", type=float, default=2.0)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--pin", action="store_true", help="pin process i to the i-th core it may use")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.procs < 1 or args.rounds < 2 or args.round_seconds <= 0:
        raise SystemExit("--procs >= 1, --rounds >= 2 and --round-seconds > 0")
    context = mp.get_context("spawn")
    queue = context.Queue()
    start_at = time.monotonic() + 5.0
    procs = [context.Process(target=_time_rounds, args=(p, args, start_at, queue)) for p in range(args.procs)]
    for proc in procs:
        proc.start()
    results = sorted(queue.get(timeout=60 + 2 * args.rounds * args.round_seconds) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    load = os.environ.get("QUIET_LOAD_BEFORE")
    rows = [{"proc": p, "round_seconds": args.round_seconds, "rounds": medians, "spread": spread(medians),
             "steps_per_round": counts, "cores": cores, "load_before": load} for p, medians, counts, cores in results]
    for row in rows:
        print(f"proc {row['proc']}: {args.rounds} rounds of {args.round_seconds:g} s "
              f"({min(row['steps_per_round'])}-{max(row['steps_per_round'])} steps), median step "
              f"{statistics.median(row['rounds']) * 1e3:.3f} ms, spread {row['spread']:.1%} (load before {load})")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
