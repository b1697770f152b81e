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

Each rank of a job is :func:`experiments.runner.run_rank` with :class:`StressRun`: the runner's loop
on the stress job's own small model and random data (:class:`StressData`, what the counts were
measured on), started by :func:`experiments.launch.run_commands` as a fresh interpreter.
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import sys

from experiments.runner import Run, run_rank

RECIPES = ("dense", "topk_adamw", "twobit_sgdm", "auto", "two_phase")
ABORT = "terminate called"
HELD_OUT_SEED = 12345


class StressData:
    """The stress job's data and model: 32 random features, 10 random classes, an MLP of 32-256-256-10.

    A training batch is drawn from ``(rank, step)`` alone; the held-out set (for the runner's final
    evaluation) is 256 samples of a fixed seed. The loss, the held-out sums and the metrics are
    :class:`experiments.objectives.HeldOutClassifier`'s (imported in the rank: the launching process
    never loads torch)."""

    name = "stress"
    default_batch_size = 32

    def __init__(self):
        import torch

        generator = torch.Generator().manual_seed(HELD_OUT_SEED)
        self.x_test, self.y_test = torch.randn(256, 32, generator=generator), torch.randint(0, 10, (256,),
                                                                                            generator=generator)

    @staticmethod
    def build_model():
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                   torch.nn.Tanh(), torch.nn.Linear(256, 10))

    @staticmethod
    def batch(rank: int, step: int, batch_size: int):
        """``(x [batch_size, 32] float32, y [batch_size] int64)`` of this rank's step."""
        import torch

        generator = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(batch_size, 32, generator=generator), torch.randint(0, 10, (batch_size,),
                                                                               generator=generator)

    def loss(self, model, x, y):
        from experiments.objectives import HeldOutClassifier

        return HeldOutClassifier.loss(model, x, y)

    def evaluate_sums(self, model, shard: int, shards: int, device):
        from experiments.objectives import HeldOutClassifier

        return HeldOutClassifier.evaluate_sums(self, model, shard, shards, device)

    def metrics(self, sums):
        from experiments.objectives import HeldOutClassifier

        return HeldOutClassifier.metrics(sums)


class StressRun(Run):
    """One rank of one stress job on the runner's loop: :class:`StressData` under DDP with
    ``--bucket-cap-mb`` buckets, the optimizer of ``--rank-of`` at a constant rate, gradcomp registered as
    the recipe says (``dense``: none); Gloo on the CPU, no evaluation before the first step, no log."""

    eval_at_start = False
    wire_bytes = False

    @classmethod
    def join_group(cls, rank: int, world_size: int, args: argparse.Namespace, local_rank):
        """The process group, one torch thread; Numba's and OpenMP's thread counts stay the environment's
        (the counts were measured with Numba's default pool)."""
        from experiments import launch

        return launch.init_rank(rank, world_size, args.threads, args.timeout, local_rank, cls.cuda)

    def build_workload(self):
        from experiments import loop as loops

        optimizer = "adamw" if self.args.rank_of == "topk_adamw" else "sgdm"
        return StressData(), loops.Loop(optimizer, 1e-3 if optimizer == "adamw" else 0.05, self.args.steps, 0)

    def build_optimizer(self):
        """AdamW (lr 1e-3) for ``topk_adamw``, else SGD (lr 0.05, momentum 0.9); no scheduler."""
        import torch

        params = self.net.parameters()
        if self.loop.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=self.loop.lr), None
        return torch.optim.SGD(params, lr=self.loop.lr, momentum=self.loop.momentum), None

    def wrap(self, net):
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(net, bucket_cap_mb=self.args.bucket_cap_mb)

    def attach(self):
        """gradcomp on ``self.model`` as ``--rank-of`` says; the bytes each step handed over."""
        import gradcomp
        from experiments import methods

        recipe, steps, backend, ddp = self.args.rank_of, self.args.steps, self.args.backend, self.model
        if recipe == "dense":
            dense_bytes = sum(p.numel() * p.element_size() for p in self.net.parameters())
            return methods.attach_method(ddp, "dense", None, dense_bytes)
        if recipe == "topk_adamw":  # the one-call recipe: frozen-variance Adam, a sparsity ramp
            state = gradcomp.register(ddp, "topk:0.01", optimizer=self.optimizer, total_steps=steps, backend=backend)
        elif recipe == "twobit_sgdm":
            state = gradcomp.register(ddp, "twobit:chunk", optimizer=self.optimizer, total_steps=steps,
                                      backend=backend)
        elif recipe == "auto":  # measures the link during the dense start, then decides per bucket
            state = gradcomp.register(ddp, gradcomp.TopK(0.01), policy=gradcomp.Auto(), warmup_steps=10,
                                      backend=backend)
        else:  # two_phase: phase 1 is a blocking all-to-all inside the hook
            state = gradcomp.register(ddp, gradcomp.TopK(0.05), exchange="two_phase", warmup_steps=2, backend=backend)
        return methods.StudyTelemetry(state=state)

    def config(self, backend: str) -> dict:
        return {"recipe": self.args.rank_of, "steps": self.args.steps, "backend": self.args.backend,
                "bucket_cap_mb": self.args.bucket_cap_mb, "world_size": self.world_size,
                "process_group_backend": backend}


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
    if args.rank_of is not None:  # one rank of a job, on the runner's loop; no log, no evaluation between steps
        run_rank(args.rank, 2, StressRun, argparse.Namespace(**vars(args), threads=1, timeout=60, log=None,
                                                             eval_every=0))
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
