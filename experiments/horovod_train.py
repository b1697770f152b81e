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

``--no-ef`` turns error feedback off for ``topk``/``twobit``. Rank 0 prints one line per
step: the loss averaged over ranks, the bytes this rank handed to collectives, the bytes
a dense float32 allreduce would have handed over, their ratio and the step time. The
workloads (scikit-learn's digits, or a character LM on the standard library's source)
need no download; see :mod:`experiments.workloads`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


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
    parser.add_argument("--log", help="JSON-lines log written by rank 0")
    args = parser.parse_args(argv)
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
    # Before torch is imported: one thread per rank unless asked otherwise.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(name, str(args.threads))
    import horovod.torch as hvd

    job = _Job(args)
    log = open(args.log, "w") if (job.rank == 0 and args.log) else None
    try:
        job.log = log
        job.announce()
        total_sent, total_time = job.train()
        job.finish(total_sent, total_time)
    finally:
        if log is not None:
            log.close()
    hvd.shutdown()
    return 0


class _Job:
    """One Horovod rank: the workload, its model, the optimizer wrapped for the method."""

    def __init__(self, args):
        import horovod.torch as hvd
        import torch

        from experiments import workloads

        torch.set_num_threads(args.threads)
        hvd.init()
        self.args, self.log = args, None
        self.rank, self.world_size = hvd.rank(), hvd.size()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", hvd.local_rank()) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        self.workload = workloads.build_workload(args.workload, seed=args.seed, small=args.small)
        self.batch_size = args.batch_size or self.workload.default_batch_size
        self.model = self.workload.build_model().to(self.device)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr or self.workload.default_lr,
                                      weight_decay=0.0)
        self.dense_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        self.optimizer, self.stock_bytes, self.method = self._wrap(optimizer)

    def batch(self, step: int):
        x, y = self.workload.batch(self.rank, step, self.batch_size)
        return x.to(self.device), y.to(self.device)

    def _wrap(self, optimizer):
        """``(the method's distributed optimizer, bytes per step of Horovod's own path or None, its name)``."""
        import horovod.torch as hvd

        from gradcomp.compressors import from_spec
        from gradcomp.hooks import horovod as gc_hvd

        args, named = self.args, list(self.model.named_parameters())
        if args.compressor in ("dense", "fp16"):
            compression = gc_hvd.Compression.fp16 if args.compressor == "fp16" else hvd.Compression.none
            wire = 2 if args.compressor == "fp16" else None
            stock = sum(p.numel() * (wire or p.element_size()) for p in self.model.parameters() if p.requires_grad)
            return (hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression), stock,
                    args.compressor)
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

        x, y = self.batch(0)
        self.workload.loss(self.model, x, y).backward()
        grads = [p.grad.reshape(-1).double() for p in self.model.parameters() if p.grad is not None]
        local_rms = torch.cat(grads).pow(2).mean().sqrt().reshape(1)
        threshold = float(hvd.allreduce(local_rms, op=hvd.Average, name="gradcomp.threshold"))
        self.model.zero_grad(set_to_none=True)
        return threshold

    def emit(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def announce(self) -> None:
        if self.rank == 0:
            params = sum(p.numel() for p in self.model.parameters())
            print(f"{self.workload.name}: {params:,} parameters, {self.world_size} ranks, method {self.method}, "
                  f"batch {self.batch_size}/rank")
        self.emit({"event": "config", **vars(self.args), "method": self.method, "world_size": self.world_size,
                   "dense_bytes": self.dense_bytes})

    def train(self):
        """``args.steps`` steps, each logged; ``(bytes sent, seconds)`` in all."""
        import horovod.torch as hvd
        import torch

        total_sent = total_time = 0.0
        for step in range(self.args.steps):
            started = time.perf_counter()
            x, y = self.batch(step)
            loss = self.workload.loss(self.model, x, y)
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            step_s = time.perf_counter() - started
            mean_loss = float(hvd.allreduce(loss.detach().reshape(1).float(), op=hvd.Average, name="loss"))
            if self.stock_bytes is not None:
                sent, dense = self.stock_bytes, self.dense_bytes
            else:
                last = self.optimizer.stats()["last_step"]
                sent, dense = last["bytes_sent"], last["dense_bytes"]
            total_sent += sent
            total_time += step_s
            if self.rank == 0:
                print(f"step {step:4d}  loss {mean_loss:.4f}  bytes_sent {sent:>10,}  dense_bytes {dense:>10,}  "
                      f"ratio {dense / sent:6.1f}x  step {1000 * step_s:7.1f} ms", flush=True)
            self.emit({"event": "step", "step": step, "loss": mean_loss, "bytes_sent": sent, "dense_bytes": dense,
                       "step_time_s": step_s})
        return total_sent, total_time

    def finish(self, total_sent: float, total_time: float) -> None:
        """The held-out metrics over every rank, printed and logged."""
        import horovod.torch as hvd

        steps = self.args.steps
        sums = self.workload.evaluate_sums(self.model, self.rank, self.world_size, self.device)
        metrics = self.workload.metrics(hvd.allreduce(sums, op=hvd.Sum, name="eval"))
        if self.rank == 0:
            pretty = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            print(f"done: {pretty}  bytes_sent/step {total_sent / steps:,.0f}  "
                  f"dense/step {self.dense_bytes:,}  mean step {1000 * total_time / steps:.1f} ms")
        self.emit({"event": "summary", **metrics, "bytes_sent_per_step": total_sent / steps,
                   "dense_bytes": self.dense_bytes})


if __name__ == "__main__":
    sys.exit(main())
