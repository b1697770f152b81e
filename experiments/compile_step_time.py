"""Step time of gradcomp's hook on a compiled model against the eager one, on 2 Gloo ranks.

    python -m experiments.compile_step_time [--spec topk:0.01] [--steps 30] [--warmup 5] [--backend inductor]

One launch runs every mode in turn on the same ranks: ``eager`` (``DDP(net)``), ``compiled_module``
(``DDP(torch.compile(net))``) and ``compiled_ddp`` (``torch.compile(DDP(net))``), each with
``gradcomp.register(..., total_steps=)`` and AdamW. The first ``--warmup`` steps (compilation, the
recipe's dense start) are left out; rank 0 prints one JSON line per mode with the median and the
quartiles of the remaining steps' wall time and their ratio to eager's median. Run it on a quiet
machine: the numbers are meant to be compared side by side within one run.
"""
import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist

from experiments import launch
from experiments import loop as loops
from experiments.objectives import HeldOutClassifier

MODES = ("eager", "compiled_module", "compiled_ddp")


def make_net(width: int = 512, depth: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def time_mode(rank: int, mode: str, args) -> list:
    """Per-step wall times (seconds) of ``mode`` after its warm-up steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp

    torch._dynamo.reset()
    net = make_net()
    if mode == "eager":
        model = DDP(net)
    elif mode == "compiled_module":
        model = DDP(torch.compile(net, backend=args.backend))
    else:
        model = torch.compile(DDP(net), backend=args.backend)
    total = args.warmup + args.steps
    loop = loops.Loop("adamw", 1e-3, total, 0)  # a constant rate: no scheduler
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop.lr)
    gradcomp.register(model, args.spec, optimizer=optimizer, total_steps=total)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(64, 512, generator=gen), torch.randint(0, 10, (64,), generator=gen))]
    times = []
    for step in range(total):
        dist.barrier()
        # The runner's timed step: forward (cross-entropy), backward, optimizer step, zero_grad.
        _, seconds = loops.timed_optimizer_step(model, HeldOutClassifier, loop, optimizer, None, batches, step)
        if step >= args.warmup:
            times.append(seconds)
    return times


def rank_main(rank: int, world_size: int, args) -> None:
    """One rank: every mode in turn (a benchmark, not a training run: it times the runner's step,
    :func:`experiments.loop.timed_optimizer_step`, on one fixed batch); rank 0 prints."""
    launch.init_rank(rank, world_size, threads=args.threads, timeout=600, cuda=False)
    try:
        eager_median = None
        for mode in args.modes:
            times = time_mode(rank, mode, args)
            q1, median, q3 = statistics.quantiles(times, n=4)
            eager_median = median if mode == "eager" else eager_median
            if rank == 0:
                print(json.dumps({"mode": mode, "backend": args.backend, "spec": args.spec, "steps": len(times),
                                  "median_s": median, "q1_s": q1, "q3_s": q3,
                                  "vs_eager": median / eager_median if eager_median else None}), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", default="topk:0.01")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    args.modes = [mode for mode in MODES if mode in args.modes]  # eager first: the others' ratios need it
    return launch.spawn_ranks(rank_main, 2, (args,), name="compile_step_time")


if __name__ == "__main__":
    sys.exit(main())
