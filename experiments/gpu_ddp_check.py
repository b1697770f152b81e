"""End-to-end check of a kernel backend inside DDP: two Gloo ranks train the same model with the
backend under test and with the torch reference, and the final parameters must agree bit for bit.

The kernels' own self-check (:mod:`experiments.gpu_selfcheck`) compares op by op; this runs them
where users do: DDP's buckets, the comm hook, error feedback across steps, the exchange of each
compressor. Both ranks share one device (Gloo moves CUDA tensors through the host), so one GPU
suffices. On a machine without a GPU, ``--device cpu --backend numba`` runs the same comparison.

Usage::

    python -m experiments.gpu_ddp_check [--device cuda] [--backend cuda] [--steps 30]

Prints one line per compressor; exit status 0 when every run matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from typing import List, Optional

from experiments import launch

#: (compressor spec, one-call recipe with AdamW?): plain error feedback into SGD-momentum, and
#: the recipe's optimizer-aware stage, whose update also runs on the device.
RUNS = (("topk:0.01", False), ("twobit:0.05", False), ("topk:0.3", False), ("topk:0.01", True))


def train(rank: int, world_size: int, device: str, backend: str, spec: str, recipe: bool, steps: int):
    """``steps`` steps of a small MLP under DDP with ``spec`` on ``backend`` (SGD-momentum, or
    AdamW through the one-call recipe); the flat float32 parameters at the end, a CPU tensor."""
    import torch

    import gradcomp

    warnings.simplefilter("ignore", gradcomp.RecipeNotice)  # the recipe's notices, once per run
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.25)
    if recipe:
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        gradcomp.register(ddp, spec, backend=backend, optimizer=optimizer, total_steps=steps)
    else:
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        gradcomp.register(ddp, spec, backend=backend, warmup_steps=1)
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        inputs = torch.randn(32, 256, generator=generator).to(device)
        target = torch.randn(32, 64, generator=generator).to(device)
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(inputs), target).backward()
        optimizer.step()
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in net.parameters()])


def rank_main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results = {}
        for run in RUNS:
            for backend in (args.backend, "torch"):
                results[(*run, backend)] = train(rank, world_size, args.device, backend, *run, args.steps)
        if rank == 0:
            torch.save(results, args.out)
    finally:
        dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="cuda", help="the kernel backend compared with 'torch'")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-time", type=float, default=300.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.out = os.path.join(tmp, "params.pt")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(launch.free_port())
        status = launch.spawn_ranks(rank_main, 2, (args,), args.max_time, name="gpu_ddp_check")
        if status:
            print(f"the ranks failed (exit status {status})")
            return 1
        import torch

        results = torch.load(args.out)
    failures = 0
    for spec, recipe in RUNS:
        tested, reference = results[spec, recipe, args.backend], results[spec, recipe, "torch"]
        differ = int((tested.view(torch.int32) != reference.view(torch.int32)).sum())
        gap = float((tested - reference).abs().max())
        verdict = "bitwise equal" if differ == 0 else f"MISMATCH: {differ} of {tested.numel()} differ"
        label = f"{spec} {'recipe, AdamW' if recipe else 'SGD-momentum'}"
        print(f"{label:<28} {args.backend} vs torch on {args.device}, {args.steps} steps, 2 ranks: {verdict}"
              f" (max |difference| {gap:.3g})")
        failures += differ != 0
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
