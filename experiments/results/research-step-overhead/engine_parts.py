"""Wall time of named pieces of gradcomp's step, per step, on the ranks of one method (an informal harness).

Each named function is wrapped by a timer (every thread: Gloo's callback too) and the method's replica is stepped
through its recipe's start and ramp (``experiments.step_times``' own set-up), then ``STEPS`` timed steps. Rank 0
prints the step and each piece's milliseconds a step (pieces nest: a caller includes its callees). From the
repository root::

    PYTHONPATH=. OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 \\
        python experiments/results/research-step-overhead/engine_parts.py charlm-small adamw twobit 150 \\
        gradcomp.engine:Engine.start,gradcomp.engine:Engine.finish

With a sixth argument ``cpu`` each piece is the CPU time of the thread that ran it (``time.thread_time``) and the
step line adds the process's CPU time a step (every thread, Gloo's too): on two ranks with a core each, the wall
time of a piece that runs on Gloo's thread counts the main thread's backward that preempts it. Run it on
one process (world size 1: no wire), or two with ``RANK=0|1 WORLD=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=...
GLOO_SOCKET_IFNAME=lo`` (the unshaped loopback). A name is ``module:Qualified.name`` where the caller looks it up
(a function imported by name into another module is wrapped there).
"""
import collections
import functools
import importlib
import os
import sys
import time
import warnings

from experiments import launch, step_times, suite
from experiments import loop as loops

spent = collections.Counter()
timing = [False]
clock = [time.perf_counter]


def wrap(module_name: str, qualified: str) -> None:
    """Replace ``module_name``'s ``qualified`` by a timed call that adds its seconds to ``spent``."""
    owner = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        start = clock[0]()
        try:
            return original(*args, **kwargs)
        finally:
            if timing[0]:
                spent[qualified] += clock[0]() - start

    setattr(owner, name, timed)


def main(workload_name: str, optimizer: str, method: str, steps: int, names: str, cpu: bool = False) -> None:
    warnings.filterwarnings("ignore")
    for spec in names.split(","):
        wrap(*spec.split(":"))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29612")
    launch.init_rank(rank, world, threads=1, timeout=600, cuda=False)
    workload = suite.build(workload_name, 0, 32)
    loop = loops.loop_for(workload_name, optimizer, step_times.PLANNED_STEPS)
    replica = step_times._replica(method, workload.build_model(), loop, 200)
    done = [0]

    def run(count: int) -> float:
        seconds = 0.0
        for _ in range(count):
            seconds += step_times._step(replica, workload, loop, rank, done[0])
            done[0] += 1
        return seconds

    step_times._to_final_setting(replica, run, method)
    timing[0], clock[0] = True, time.thread_time if cpu else time.perf_counter
    process = time.process_time()
    total = run(steps)
    process = time.process_time() - process
    if rank == 0:
        print(f"step {total / steps * 1e3:.2f} ms" + (f", process CPU {process / steps * 1e3:.2f} ms" if cpu else ""))
        for name, seconds in spent.most_common():
            print(f"{seconds / steps * 1e3:8.3f} ms  {name}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:] == ["cpu"])
