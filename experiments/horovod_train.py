"""Horovod training example: one workload, one gradient-communication method.

Run it under horovodrun from the repository root (2 ranks over Gloo on this machine)::

    horovodrun -np 2 --gloo -H localhost:2 \\
        python -m experiments.horovod_train --compressor topk --density 0.01 --steps 50

Methods (``--compressor``):

=============  ===============================================================================
``dense``      ``hvd.DistributedOptimizer`` with no compression (Horovod's allreduce)
``fp16``       ``hvd.DistributedOptimizer(compression=gradcomp.hooks.horovod.Compression.fp16)``
``topk``       ``gradcomp.hooks.horovod.DistributedOptimizer`` with ``from_spec("topk:<--density>")``
``twobit``     ``gradcomp.hooks.horovod.DistributedOptimizer`` with ``from_spec("twobit:<--threshold>")``
``bf16``       ``gradcomp.hooks.horovod.DistributedOptimizer`` with ``from_spec("bf16")`` (allgathered:
               Horovod 0.28.1 cannot allreduce bfloat16)
=============  ===============================================================================

``--no-ef`` turns error feedback off for ``topk``/``twobit``.

``--study-spec`` runs a convergence study's run instead (a :class:`experiments.convergence.RunSpec`
as JSON: its workload from :mod:`experiments.suite`, its own loop and optimizer; ``dense``/``fp16``
through Horovod's optimizer, ``topk``/``twobit`` through gradcomp's with the one-call recipe over
``--planned-steps`` or the run's steps) and logs the study's records (``config``, ``step``,
``eval``, ``done``); ``python -m experiments.convergence --parallel horovod`` starts these
(:func:`run_study`).

Rank 0 prints one line per step: its loss, the bytes this rank handed to collectives, the bytes a
dense float32 allreduce would have handed over, their ratio and the step time. The workloads
(scikit-learn's digits, or a character LM on the standard library's source) need no download; see
:mod:`experiments.workloads`.

Each rank is :func:`experiments.runner.run_rank` with :class:`HorovodRun`: the runner's loop, step
timing (without drawing the batch), held-out evaluation (``--eval-every``, and at the end) and log
(``--log``, rank 0, JSON lines: ``config``, ``step``, ``eval``, then ``summary``), with Horovod's
ranks and its distributed optimizer in place of a process group and DDP.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from experiments.launch import set_thread_env
from experiments.runner import Run, run_rank, timing_summary, workload_and_loop

#: The convergence study's methods a Horovod run takes (``--study-spec``).
STUDY_METHODS = ("dense", "fp16", "topk", "twobit")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.horovod_train",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("digits", "charlm"), default="digits")
    parser.add_argument("--small", action="store_true", help="charlm: the small preset")
    parser.add_argument("--compressor", choices=("dense", "fp16", "topk", "twobit", "bf16"), default="topk")
    parser.add_argument(
        "--density", type=float, default=0.01, help="top-k: the fraction of entries sent (default 0.01)"
    )
    parser.add_argument(
        "--threshold", default="auto",
        help="2-bit threshold: a positive number, or 'auto' (default): the RMS of the first "
        "step's gradient, averaged over ranks",
    )  # fmt: skip
    parser.add_argument("--no-ef", action="store_true", help="top-k/2-bit without error feedback")
    parser.add_argument("--warmup-steps", type=int, default=0, help="dense steps before compression starts")
    parser.add_argument("--min-numel", type=int, default=1024, help="parameters smaller than this go dense")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--lr", type=float, help="learning rate (default: the workload's, 1e-3 with AdamW)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch (default: the workload's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP/numba threads per rank")
    parser.add_argument("--backend", help="gradcomp kernel backend override (one of gradcomp.backends.BACKENDS)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out evaluation every N steps (0: at the end)")
    parser.add_argument("--log", help="JSON-lines log written by rank 0")
    parser.add_argument("--study-spec", help="a convergence study's run (RunSpec as JSON): replaces the workload, "
                        "the loop, --compressor and --steps")
    parser.add_argument("--planned-steps", type=int, help="the recipe's total_steps (default: the run's steps)")
    parser.add_argument("--code-steps", type=int, help="--study-spec: the run whose 2-bit code the recipe runs "
                        "(experiments.methods.study_spec; default: the recipe's total_steps)")
    args = parser.parse_args(argv)
    args.suite_spec = json.loads(args.study_spec) if args.study_spec else None
    if args.suite_spec is not None:
        if args.suite_spec["method"] not in STUDY_METHODS:
            parser.error(f"--study-spec: method {args.suite_spec['method']!r} does not run under Horovod here; "
                         f"choose one of {STUDY_METHODS}")
        args.compressor, args.steps = args.suite_spec["method"], args.suite_spec["steps"]
        args.eval_every = args.suite_spec["eval_every"]
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.threshold not in ("auto", "rms"):
        try:
            args.threshold = float(args.threshold)
        except ValueError:
            args.threshold = math.nan
        if not args.threshold > 0 or not math.isfinite(args.threshold):
            parser.error(f"--threshold must be a positive number, 'rms' or 'auto', got {args.threshold!r}")
    if args.backend is not None:
        from gradcomp.backends import BACKENDS

        if args.backend not in BACKENDS:
            parser.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    set_thread_env(args.threads)  # before torch is imported (by Horovod)
    import horovod.torch as hvd

    hvd.init()
    run_rank(hvd.rank(), hvd.size(), HorovodRun, args, hvd.local_rank())
    return 0


class HorovodTelemetry:
    """Per step, ``bytes_sent`` (what this rank handed to Horovod's collectives) and ``dense_bytes`` (a
    dense float32 allreduce's): fixed for Horovod's own path (``stock_bytes``), else the gradcomp
    optimizer's ``stats()`` of its last step."""

    def __init__(self, optimizer, dense_bytes: int, stock_bytes: Optional[int]):
        self.optimizer, self.dense_bytes, self.stock_bytes = optimizer, dense_bytes, stock_bytes

    def end_step(self) -> dict:
        if self.stock_bytes is not None:
            return {"bytes_sent": self.stock_bytes, "dense_bytes": self.dense_bytes}
        last = self.optimizer.stats()["last_step"]
        return {"bytes_sent": last["bytes_sent"], "dense_bytes": last["dense_bytes"]}


class HorovodRun(Run):
    """One Horovod rank on the runner's loop: the workload's model, its parameters broadcast from rank 0,
    AdamW at a constant rate wrapped in the method's distributed optimizer; Horovod's collectives (the
    rank already initialised by :func:`main`), the GPU ``local_rank`` where there is one."""

    cuda = True
    eval_at_start = False
    done_record = False

    @classmethod
    def join_group(cls, rank: int, world_size: int, args: argparse.Namespace, local_rank):
        """The threads and the device; Horovod's ranks were joined by ``hvd.init()``."""
        from experiments import launch

        return launch.rank_device(rank, args.threads, local_rank, cls.cuda), "horovod"

    @classmethod
    def leave_group(cls, finished: bool) -> None:
        """Wait for every rank where the run ``finished``; shut Horovod down."""
        import horovod.torch as hvd

        try:
            if finished:
                hvd.barrier()
        finally:
            hvd.shutdown()

    def build_workload(self):
        """A study's workload and loop (``--study-spec``), else the command line's, with AdamW at a
        constant rate."""
        from experiments import loop as loops
        from experiments import workloads

        args = self.args
        if args.suite_spec is not None:
            self.done_record = True
            workload, loop = workload_and_loop(args)
            if loop.clip or loop.accumulation > 1:
                raise SystemExit(f"horovod_train: {workload.name}'s loop clips or accumulates; the Horovod run "
                                 "covers loops without (synchronize() before the clip is not wired here)")
            return workload, loop
        workload = workloads.build_workload(args.workload, seed=args.seed, small=args.small)
        return workload, loops.Loop("adamw", args.lr or workload.default_lr, args.steps, 0)

    def build_optimizer(self):
        """A study's optimizer and scheduler (:func:`experiments.loop.build_optimizer`), else AdamW at the
        loop's rate, no weight decay, no scheduler (:meth:`attach` wraps it)."""
        import torch

        from experiments import loop as loops

        if self.args.suite_spec is not None:
            return loops.build_optimizer(self.loop, self.net)
        return torch.optim.AdamW(self.net.parameters(), lr=self.loop.lr, weight_decay=0.0), None

    def wrap(self, net):
        """``net`` itself, its parameters broadcast from rank 0: the distributed optimizer exchanges."""
        import horovod.torch as hvd

        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        return net

    def attach(self):
        """Wrap ``self.optimizer`` in the method's distributed optimizer (replacing it); its telemetry."""
        params = [p for p in self.net.parameters() if p.requires_grad]
        self.dense_bytes = sum(p.numel() * p.element_size() for p in params)
        self.optimizer, stock_bytes, self.method = self._distributed_optimizer(self.optimizer)
        self.total_sent = 0
        return HorovodTelemetry(self.optimizer, self.dense_bytes, stock_bytes)

    def _distributed_optimizer(self, optimizer):
        """``(the method's distributed optimizer, bytes per step of Horovod's own path or None, its name)``."""
        from gradcomp.compressors import from_spec
        from gradcomp.hooks import horovod as gc_hvd

        args, named = self.args, list(self.net.named_parameters())
        if args.compressor in ("dense", "fp16") or args.suite_spec is not None:
            planned = args.planned_steps or args.steps
            wrapped, stock = study_optimizer(args.compressor, self.net, optimizer, self.scheduler, planned,
                                             args.code_steps or planned)
            return wrapped, stock, args.compressor
        if args.compressor == "topk":
            compressor = from_spec(f"topk:{args.density!r}")
        elif args.compressor == "twobit":
            threshold = self._first_rms() if args.threshold == "auto" else args.threshold
            compressor = from_spec(f"twobit:{threshold!r}" if isinstance(threshold, float) else f"twobit:{threshold}")
        else:
            compressor = from_spec(args.compressor)
        wrapped = gc_hvd.DistributedOptimizer(
            optimizer, named_parameters=named, compression=compressor, warmup_steps=args.warmup_steps,
            min_numel=args.min_numel, error_feedback=not args.no_ef, backend=args.backend,
        )  # fmt: skip
        method = args.compressor
        if args.compressor in ("topk", "twobit"):
            method = f"{compressor!r}" + (" without error feedback" if args.no_ef else "")
        return wrapped, None, method

    def _first_rms(self) -> float:
        """The RMS of a first gradient, averaged over ranks so all decode alike."""
        import horovod.torch as hvd
        import torch

        x, y = self.workload.batch(self.rank, 0, self.batch_size)
        self.workload.loss(self.net, x.to(self.device), y.to(self.device)).backward()
        grads = [p.grad.reshape(-1).double() for p in self.net.parameters() if p.grad is not None]
        local_rms = torch.cat(grads).pow(2).mean().sqrt().reshape(1)
        threshold = float(hvd.allreduce(local_rms, op=hvd.Average, name="gradcomp.threshold"))
        self.net.zero_grad(set_to_none=True)
        return threshold

    def config(self, backend: str) -> dict:
        """The config record; rank 0 also prints the run's one-line description. A study's run records
        its RunSpec's fields, ``"parallel": "horovod"`` and the recipe's plan."""
        if self.args.suite_spec is not None:
            import torch

            from experiments import fingerprint

            plan = getattr(self.optimizer, "recipe", None)
            return {**self.args.suite_spec, "buckets": "per parameter", "engine": "horovod", "parallel": "horovod",
                    "code": fingerprint.code(), "machine": fingerprint.machine(),
                    "loop": self.loop.describe(), "world_size": self.world_size,
                    "batch_size": self.batch_size, "link": os.environ.get("GRADCOMP_LINK", "unshaped"),
                    "torch": torch.__version__,
                    "planned_steps": self.args.planned_steps, "recipe": plan.summary if plan is not None else None,
                    "params": sum(p.numel() for p in self.net.parameters())}
        if self.rank == 0:
            params = sum(p.numel() for p in self.net.parameters())
            print(f"{self.workload.name}: {params:,} parameters, {self.world_size} ranks, method {self.method}, "
                  f"batch {self.batch_size}/rank", flush=True)
        return {**vars(self.args), "method": self.method, "world_size": self.world_size,
                "dense_bytes": self.dense_bytes, "process_group_backend": backend, "device": str(self.device),
                "batch_size": self.batch_size, "lr": self.loop.lr}

    def step(self, step: int, train_time: float) -> dict:
        """The runner's step; rank 0 prints it."""
        record = super().step(step, train_time)
        self.total_sent += record["bytes_sent"]
        if self.rank == 0:
            sent, dense = record["bytes_sent"], record["dense_bytes"]
            print(f"step {step:4d}  loss {record['loss']:.4f}  bytes_sent {sent:>10,}  dense_bytes {dense:>10,}  "
                  f"ratio {dense / sent:6.1f}x  step {1000 * record['step_time_s']:7.1f} ms", flush=True)
        return record

    def held_out_sums(self):
        """The workload's held-out sums over every rank (Horovod's allreduce)."""
        import horovod.torch as hvd

        sums = self.workload.evaluate_sums(self.net, self.rank, self.world_size, self.device)
        return hvd.allreduce(sums, op=hvd.Sum, name="eval").cpu()

    def summarize(self, final: dict, train_time: float, step_times: list, losses: list) -> None:
        """The summary record; rank 0 prints the final metrics, the bytes and the mean step time."""
        steps = self.args.steps
        if self.rank == 0:
            pretty = "  ".join(f"{k} {v:.4f}" for k, v in final.items())
            print(f"done: {pretty}  bytes_sent/step {self.total_sent / steps:,.0f}  "
                  f"dense/step {self.dense_bytes:,}  mean step {1000 * train_time / steps:.1f} ms", flush=True)
        self.emit({"event": "summary", **final, "bytes_sent_per_step": self.total_sent / steps,
                   "dense_bytes": self.dense_bytes, **timing_summary(train_time, step_times, losses)})


def study_optimizer(method: str, net, optimizer, scheduler, planned: int, code_steps: int, prefix: str = ""):
    """``(distributed optimizer, bytes a rank hands Horovod per step or None)`` of a study's ``method`` over ``net``'s
    parameters, named ``prefix + name`` (unique names let several models exchange in one process):
    ``dense``/``fp16`` Horovod's optimizer (fp16 through gradcomp's Horovod compressor; its bytes fixed),
    ``topk``/``twobit`` gradcomp's with the one-call recipe planned for ``planned`` steps under
    ``scheduler`` (the 2-bit code of a ``code_steps`` run). Wraps ``optimizer``, whose ``param_groups``
    the wrapper shares."""
    import horovod.torch as hvd

    from experiments.methods import study_spec
    from gradcomp.compressors import from_spec
    from gradcomp.hooks import horovod as gc_hvd

    named = [(prefix + name, p) for name, p in net.named_parameters()]
    if method in ("dense", "fp16"):
        compression = gc_hvd.Compression.fp16 if method == "fp16" else hvd.Compression.none
        wire = 2 if method == "fp16" else None
        stock = sum(p.numel() * (wire or p.element_size()) for p in net.parameters() if p.requires_grad)
        return hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression), stock
    spec_text = study_spec(method, net, optimizer, code_steps)
    return gc_hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=from_spec(spec_text),
                                       total_steps=planned, scheduler=scheduler), None


def horovodrun_command(argv, world_size: int = 2, module: str = "experiments.horovod_train") -> list:
    """``horovodrun`` (beside this Python where installed there) of ``python -m MODULE``
    with ``argv``: ``world_size`` local ranks over Gloo, one thread each (``--threads``'s default). The
    arguments go as one shell word: horovodrun would read ``--log`` after the command as its own option."""
    import shlex

    beside = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    launcher = beside if os.path.exists(beside) else "horovodrun"
    inner = shlex.join([sys.executable, "-m", module, *argv])
    return [launcher, "-np", str(world_size), "--gloo", "-H", f"localhost:{world_size}", "sh", "-c", inner]


def run_study(specs, runs_dir: str, args) -> int:
    """Run the convergence study's ``specs`` (:class:`experiments.convergence.RunSpec`) under horovodrun,
    ``args.nproc`` ranks, one after another on the unshaped loopback; logs ``<stem>__horovod.jsonl`` with
    the study's records. Returns the number that failed; a method Horovod does not run is skipped."""
    from dataclasses import asdict

    from experiments.convergence import run_launched

    def command(spec, log_path: str) -> list:
        return horovodrun_command(["--study-spec", json.dumps(asdict(spec)), "--log", log_path], args.nproc)

    return run_launched(specs, runs_dir, "horovod", STUDY_METHODS, command, args.run_timeout)

if __name__ == "__main__":
    sys.exit(main())
