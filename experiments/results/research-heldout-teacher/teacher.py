"""A model of no workload of the study: an MLP (32 -> 256 -> 8, ReLU) regressing a fixed random linear teacher,
2 Gloo ranks of DDP on one machine, 16 samples a rank a step, the recipe registered with the run's length.
Prints, per optimizer and method, each seed's held-out MSE (512 samples) and the median against dense's.

Usage, from the repository root: ``PYTHONPATH=. python experiments/results/research-heldout-teacher/teacher.py
[--steps 200] [--seeds 0,1,2] [--optimizers sgd,adamw] [--methods dense,topk,...]``. A method is ``dense``, a recipe
spec (``topk``, ``twobit``, ``topk:0.05``), or ``SPEC@parameter``: the recipe with ``granularity="parameter"``
(each parameter's own top-k) in place of its choice. Probes, not gradcomp: ``--momentum M --lr L`` for SGD's
(default 0.9 and 0.05), ``--cosine`` (the rate decayed to 0 over the run, the scheduler given to the recipe),
``--refresh W`` (AdamW: the recipe's stage with ``FrozenVarianceAdam(refresh=W)``, gradcomp since c7dbccb),
``--delay D`` (gradcomp at 8498836 and before, whose stage shortened the momentum): ``DelayedMomentumSGD`` gives up
``D`` steps of the momentum's memory on every compressed step (``delay_at`` replaced; 9 leaves none of momentum
0.9's: plain SGD at 10x the rate).
"""
import argparse
import os
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

METHODS = {"sgd": ["dense", "topk", "topk@parameter", "topk:0.05", "twobit"],
           "adamw": ["dense", "topk", "topk@parameter", "twobit"]}


def held_out(rank: int, optimizer_name: str, method: str, seed: int, args) -> float:
    import gradcomp
    import gradcomp.optim.delayed_momentum as delayed

    if args.delay is not None:
        if not hasattr(delayed, "delay_at"):
            raise SystemExit("--delay probes the stage that shortened the momentum (gradcomp at 8498836 and before); "
                             "the stage since catches up each coordinate's late gradient instead")
        delayed.delay_at = lambda density, delay_steps=None: args.delay if 0 < density < 1 else 0.0
    steps = args.steps

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    teacher = torch.nn.Linear(32, 8)
    torch.nn.init.normal_(teacher.weight, std=0.5)
    teacher.requires_grad_(False)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = (torch.optim.AdamW(net.parameters(), lr=1e-3) if optimizer_name == "adamw"
                 else torch.optim.SGD(net.parameters(), lr=args.lr, momentum=args.momentum))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps) if args.cosine else None
    if method != "dense":
        spec, _, granularity = method.partition("@")
        state = gradcomp.register(ddp, spec, optimizer=optimizer, total_steps=steps, scheduler=scheduler,
                                  **({"granularity": granularity} if granularity else {}))
        if args.refresh is not None:  # FrozenVarianceAdam's option (gradcomp.optim.variance_refresh)
            state.engine.transform.refresh = args.refresh
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * seed + 10 * step + rank))
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), teacher(x)).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(10 ** 6 + seed))
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x), teacher(x)).item()


def rank_main(rank: int, args) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    seeds = [int(s) for s in args.seeds.split(",")]
    for optimizer_name in args.optimizers.split(","):
        methods = args.methods.split(",") if args.methods else METHODS[optimizer_name]
        losses = {m: [held_out(rank, optimizer_name, m, s, args) for s in seeds] for m in methods}
        if rank == 0:
            dense = losses["dense"]
            for method, values in losses.items():
                gaps = [v / d - 1 for v, d in zip(values, dense)]
                print(f"| {optimizer_name} | {method} | {' / '.join(f'{v:.4f}' for v in values)} | "
                      f"{statistics.median(gaps):+.1%} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--optimizers", default="sgd,adamw")
    parser.add_argument("--methods", default="", help="comma-separated; default: every method of each optimizer")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--delay", type=float, default=None)
    parser.add_argument("--cosine", action="store_true", help="a cosine decay of the rate to 0 over the run")
    parser.add_argument("--refresh", type=float, default=None, help="Adam's stage refreshes its variance, renewing "
                        "this share of it each time (FrozenVarianceAdam(refresh=...))")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29761")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print("| optimizer | method | held-out MSE, seeds | median against dense |\n|---|---|---|---|", flush=True)
    mp.spawn(rank_main, args=(parser.parse_args(),), nprocs=2)
