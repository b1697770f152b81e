"""Stress benchmark for a clean exit: N two-rank DDP jobs of M steps per recipe, counting exit codes.

A finished rank must exit with code 0. Long runs were seen to end, after the result was written
and the process group destroyed, with ``terminate called without an active exception`` (SIGABRT,
exit code -6), also in jobs that used no gradcomp at all. This script runs the same jobs with
each recipe, and with none (``--recipes dense``: torch's own DDP allreduce), so that a count of
aborts can be compared between torch alone and gradcomp's recipes on the same machine.

Usage (each job is two fresh Python processes; jobs run one after another)::

    python -m experiments.exit_codes --jobs 50 --steps 600 --recipes dense topk_adamw twobit_sgdm auto two_phase
    python -m experiments.exit_codes --jobs 3 --steps 100            # a quick check that it runs

Prints one line per job (recipe, exit codes, an abort message seen in stderr) and a table:
jobs, clean exits, and the exit codes of the others. Not a test: it takes minutes per recipe.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys

RECIPES = ("dense", "topk_adamw", "twobit_sgdm", "auto", "two_phase")
ABORT = "terminate called"


def _optimizer_and_state(recipe: str, ddp, model, steps: int, backend: str):
    """The job's optimizer, with gradcomp registered on ``ddp`` as ``recipe`` says (``dense``: none)."""
    import torch

    import gradcomp

    if recipe == "topk_adamw":  # the one-call recipe: frozen-variance Adam, a sparsity ramp
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gradcomp.register(ddp, "topk:0.01", optimizer=optimizer, total_steps=steps, backend=backend)
        return optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if recipe == "twobit_sgdm":
        gradcomp.register(ddp, "twobit:chunk", optimizer=optimizer, total_steps=steps, backend=backend)
    elif recipe == "auto":  # measures the link during the dense start, then decides per bucket
        gradcomp.register(ddp, gradcomp.TopK(0.01), policy=gradcomp.Auto(), warmup_steps=10, backend=backend)
    elif recipe == "two_phase":  # phase 1 is a blocking all-to-all inside the hook
        gradcomp.register(ddp, gradcomp.TopK(0.05), exchange="two_phase", warmup_steps=2, backend=backend)
    return optimizer


def _rank(rank: int, world_size: int, recipe: str, steps: int, backend: str, bucket_cap_mb: float) -> None:
    """One rank of one job: train ``steps`` steps with ``recipe``, destroy the group, return. Its own small
    loop, not the runner's: the model and the data of the stress job are what its counts were measured on."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from experiments import launch

    launch.init_rank(rank, world_size, threads=1, timeout=60, cuda=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = _optimizer_and_state(recipe, ddp, model, steps, backend)
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
    dist.destroy_process_group()


def run_job(recipe: str, steps: int, backend: str, bucket_cap_mb: float, timeout_s: float):
    """Run one two-rank job to its end; ``(exit codes, whether stderr showed an abort, stderr tail)``."""
    from experiments import launch

    command = [sys.executable, "-m", "experiments.exit_codes", "--rank-of", recipe, "--steps", str(steps),
               "--backend", backend, "--bucket-cap-mb", str(bucket_cap_mb)]
    codes, errors = launch.run_commands([command + ["--rank", str(rank)] for rank in range(2)], timeout=timeout_s,
                                        stderr_text=True, stdout=subprocess.DEVNULL)
    return codes, any(ABORT in err for err in errors), " | ".join(err[-300:] for err in errors if err.strip())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=50, help="jobs per recipe")
    parser.add_argument("--steps", type=int, default=500, help="training steps per job")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--backend", default="numba", choices=("torch", "numba"))
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (0.01: per parameter)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per job")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # internal: run one rank
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of is not None:
        _rank(args.rank, 2, args.rank_of, args.steps, args.backend, args.bucket_cap_mb)
        return
    table = {}
    for recipe in args.recipes:
        codes_seen = collections.Counter()
        clean = aborts = 0
        for job in range(args.jobs):
            codes, aborted, tail = run_job(recipe, args.steps, args.backend, args.bucket_cap_mb, args.timeout_s)
            clean += codes == [0, 0]
            aborts += aborted
            codes_seen.update(code for code in codes if code != 0)
            print(f"{recipe} job {job + 1}/{args.jobs}: exit codes {codes}" + (f"; {tail}" if tail else ""),
                  flush=True)
        table[recipe] = (clean, aborts, dict(codes_seen))
    print(f"\n{args.jobs} two-rank jobs of {args.steps} steps per recipe, backend {args.backend}")
    print(f"{'recipe':<12} {'clean':>6} {'aborts':>7}  other exit codes")
    for recipe, (clean, aborts, others) in table.items():
        print(f"{recipe:<12} {clean:>6} {aborts:>7}  {others or '-'}")


if __name__ == "__main__":
    main()
