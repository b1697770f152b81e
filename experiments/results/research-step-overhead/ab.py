"""Interleaved step times of several replicas of one workload (2 ranks on the unshaped loopback, one thread each), each
after 45 untimed steps (past the recipes' dense start and ramp); prints each method's median step and its median
paired ratio to the first method's. Not a quiet benchmark: a diagnosis of where a step's time goes.

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-step-overhead/ab.py WORKLOAD
OPTIMIZER STEPS METHOD...``; a METHOD is one of ``experiments.step_times``'s (``dense``, ``fp16``, ``topk``, ...),
or ``gc-SPEC``: ``gradcomp.hooks.ddp.register(model, SPEC)`` alone, without an optimizer stage, or
``floor-BYTES`` / ``ring-BYTES``: a comm hook that exchanges a BYTES-byte payload per bucket through
``gradcomp.hooks.direct.gather`` / Gloo's own allgather and hands DDP's bucket back unchanged (no compression,
no average: the step of any compressor that exchanges that payload once a bucket, its own work at zero).
Add ``--profile FILE`` to write rank 0's cProfile of the timed steps of the first method, ``--walltime`` to print
rank 0's wall-clock totals of the step's named functions by thread over every method's timed steps (time one
method: :mod:`walltime`). ``topk-perpart`` is the ``topk`` recipe with its parts selected one by one (the batched
form taken out of the registry around its steps), to pair against ``topk``; ``twobit-unfused`` the ``twobit``
recipe with the stage's ``divisor`` hidden around its steps (the gradient divided into a copy before the compress,
the average multiplied back after), to pair against ``twobit``; ``twobit-rankwise`` the ``twobit`` recipe with the
average decoded rank by rank (``PerParameter.averages`` off around its steps), to pair against ``twobit``.
"""
import os
import statistics
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")


def make(method, net, loop, workload_name):
    """``(ddp model, optimizer, scheduler, gradcomp state or None)`` of ``method`` on a copy of ``net``."""
    method = {"topk-perpart": "topk", "twobit-unfused": "twobit", "twobit-rankwise": "twobit", "topk-inhook": "topk",
              "twobit-inhook": "twobit"}.get(method, method)
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from experiments import loop as loops
    from experiments import step_times, suite

    if method.startswith(("floor-", "ring-")):
        return floor_replica(method, net, loop)
    if not method.startswith("gc-"):
        return step_times._replica(method, net, loop, suite.STEPS[workload_name])
    from gradcomp.hooks import ddp as gradcomp_ddp

    model = copy.deepcopy(net)
    ddp = DistributedDataParallel(model)
    optimizer, scheduler = loops.build_optimizer(loop, model)
    return ddp, optimizer, scheduler, gradcomp_ddp.register(ddp, method[3:])


def floor_replica(method, net, loop):
    """A DDP replica whose comm hook only exchanges a fixed payload a bucket (module docstring)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from experiments import loop as loops
    from gradcomp.hooks import direct

    kind, size = method.split("-")
    model = copy.deepcopy(net)
    ddp = DistributedDataParallel(model)
    optimizer, scheduler = loops.build_optimizer(loop, model)
    payload = torch.zeros(int(size), dtype=torch.uint8)
    rank, world = dist.get_rank(), dist.get_world_size()

    def hook(state, bucket):
        buffer = bucket.buffer()
        if kind == "floor":
            future = direct.gather(payload, None, rank, world, f"floor{bucket.index()}")
        else:
            out = torch.empty(world * payload.numel(), dtype=torch.uint8)
            future = dist.all_gather_into_tensor(out, payload, async_op=True).get_future()
        return future.then(lambda _: buffer)

    ddp.register_comm_hook(None, hook)
    return ddp, optimizer, scheduler, None


class InHook:
    """``gradcomp.hooks.direct``'s posts made on the calling thread, the hook's (before 1c799b9)."""

    def add(self, post, future, value):
        from gradcomp.hooks import direct

        works = []
        post(works)
        direct._COMPLETIONS.add(works, future, value)


def _step(method, replica, workload, loop, rank, i):
    """One timed step of ``method``'s replica (``topk-perpart``: without top-k's batched form over the parts)."""
    import gradcomp.backends as backends
    from experiments import step_times
    from gradcomp.compressors.per_parameter import PerParameter
    from gradcomp.hooks import direct
    from gradcomp.optim import FrozenVarianceAdam

    key = ("topk_compress/parts", "numba")
    held = backends.KERNELS.pop(key) if method == "topk-perpart" else None
    divisor = FrozenVarianceAdam.divisor
    if method == "twobit-unfused":
        FrozenVarianceAdam.divisor = None  # the engine then calls before_compress and after_average
    averages = PerParameter.averages
    if method == "twobit-rankwise":
        PerParameter.averages = False  # average_gathered then decodes rank by rank
    posts = direct._POSTS
    if method.endswith("-inhook"):
        direct._POSTS = InHook()
    try:
        return step_times._step(replica, workload, loop, rank, i)
    finally:
        direct._POSTS = posts
        FrozenVarianceAdam.divisor = divisor
        PerParameter.averages = averages
        if held is not None:
            backends.KERNELS[key] = held


def rank_main(rank, argv):
    import cProfile
    import warnings

    import torch.distributed as dist

    from experiments import launch, step_times, suite
    from experiments import loop as loops

    warnings.filterwarnings("ignore")
    profile = argv.pop(argv.index("--profile") + 1) if "--profile" in argv else None
    walltime = None
    if "--walltime" in argv:
        import walltime  # beside this script, on the path a script's directory is

        walltime.install()
    argv = [a for a in argv if a not in ("--profile", "--walltime")]
    launch.init_rank(rank, 2, threads=1, timeout=600, cuda=False)
    name, optimizer, steps, *methods = argv
    workload = suite.build(name, 0, 32)
    loop = loops.loop_for(name, optimizer, step_times.PLANNED_STEPS)
    net = workload.build_model()
    replicas = {m: make(m, net, loop, name) for m in methods}
    for m in methods:
        for i in range(step_times.PLANNED_STEPS + 5):
            _step(m, replicas[m], workload, loop, rank, i)
    seconds = {m: [] for m in methods}
    if walltime:
        walltime.reset()
    profiler = cProfile.Profile() if profile and rank == 0 else None
    for i in range(int(steps)):
        for j in range(len(methods)):
            m = methods[(i + j) % len(methods)]
            if profiler and m == methods[0]:
                profiler.enable()
            seconds[m].append(_step(m, replicas[m], workload, loop, rank, 100 + i))
            if profiler and m == methods[0]:
                profiler.disable()
    if rank == 0:
        for m in methods:
            ratios = [a / b for a, b in zip(seconds[m], seconds[methods[0]])]
            median = statistics.median(seconds[m]) * 1000
            print(f"{m:>16} {median:8.2f} ms  x{methods[0]} {statistics.median(ratios):.3f}")
            if m + "-inhook" in seconds:
                before = seconds[m + "-inhook"]
                paired = [a / b for a, b in zip(seconds[m], before)]
                print(f"{m:>16} / {m}-inhook paired median {statistics.median(paired):.3f}, mean step "
                      f"{statistics.mean(seconds[m]) * 1e3:.2f} / {statistics.mean(before) * 1e3:.2f} ms")
        if walltime:
            walltime.report(int(steps))
        if profiler:
            profiler.dump_stats(profile)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    from experiments import launch

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(launch.free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(rank_main, args=(sys.argv[1:],), nprocs=2)
