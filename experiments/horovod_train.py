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
    import torch

    from experiments import workloads
    from gradcomp.compressors import from_spec
    from gradcomp.hooks import horovod as gc_hvd

    torch.set_num_threads(args.threads)
    hvd.init()
    rank, world_size = hvd.rank(), hvd.size()
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    workload = workloads.build_workload(args.workload, seed=args.seed, small=args.small)
    batch_size = args.batch_size or workload.default_batch_size
    model = workload.build_model().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr or workload.default_lr, weight_decay=0.0)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)

    def batch(step):
        x, y = workload.batch(rank, step, batch_size)
        return x.to(device), y.to(device)

    named = list(model.named_parameters())
    if args.compressor in ("dense", "fp16"):
        compression = gc_hvd.Compression.fp16 if args.compressor == "fp16" else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
        wire_size = 2 if args.compressor == "fp16" else None
        stock_bytes = sum(p.numel() * (wire_size or p.element_size()) for p in model.parameters() if p.requires_grad)
    else:
        if args.compressor == "topk":
            compressor = from_spec(f"topk:{args.density!r}")
        elif args.compressor == "twobit":
            threshold = args.threshold
            if threshold == "auto":
                # The RMS of a first gradient, averaged over ranks so all decode alike.
                x, y = batch(0)
                workload.loss(model, x, y).backward()
                grads = [p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None]
                local_rms = torch.cat(grads).pow(2).mean().sqrt().reshape(1)
                threshold = float(hvd.allreduce(local_rms, op=hvd.Average, name="gradcomp.threshold"))
                model.zero_grad(set_to_none=True)
            compressor = from_spec(f"twobit:{threshold!r}" if isinstance(threshold, float) else f"twobit:{threshold}")
        else:
            compressor = from_spec(args.compressor)
        optimizer = gc_hvd.DistributedOptimizer(
            optimizer, named_parameters=named, compression=compressor, warmup_steps=args.warmup_steps,
            min_numel=args.min_numel, error_feedback=not args.no_ef, backend=args.backend,
        )  # fmt: skip
        stock_bytes = None

    log = open(args.log, "w") if (rank == 0 and args.log) else None

    def emit(record):
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()

    method = args.compressor
    if args.compressor in ("topk", "twobit"):
        method = f"{compressor!r}" + (" without error feedback" if args.no_ef else "")
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{workload.name}: {params:,} parameters, {world_size} ranks, method {method}, batch {batch_size}/rank")
    emit({"event": "config", **vars(args), "method": method, "world_size": world_size, "dense_bytes": dense_bytes})

    total_sent = total_time = 0.0
    for step in range(args.steps):
        started = time.perf_counter()
        x, y = batch(step)
        loss = workload.loss(model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - started
        mean_loss = float(hvd.allreduce(loss.detach().reshape(1).float(), op=hvd.Average, name="loss"))
        if stock_bytes is not None:
            sent, dense = stock_bytes, dense_bytes
        else:
            last = optimizer.stats()["last_step"]
            sent, dense = last["bytes_sent"], last["dense_bytes"]
        total_sent += sent
        total_time += step_s
        if rank == 0:
            print(
                f"step {step:4d}  loss {mean_loss:.4f}  bytes_sent {sent:>10,}  dense_bytes {dense:>10,}  "
                f"ratio {dense / sent:6.1f}x  step {1000 * step_s:7.1f} ms",
                flush=True,
            )
        emit({"event": "step", "step": step, "loss": mean_loss, "bytes_sent": sent, "dense_bytes": dense,
              "step_time_s": step_s})  # fmt: skip

    sums = workload.evaluate_sums(model, rank, world_size, device)
    sums = hvd.allreduce(sums, op=hvd.Sum, name="eval")
    metrics = workload.metrics(sums)
    if rank == 0:
        pretty = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        print(f"done: {pretty}  bytes_sent/step {total_sent / args.steps:,.0f}  "
              f"dense/step {dense_bytes:,}  mean step {1000 * total_time / args.steps:.1f} ms")  # fmt: skip
    emit({"event": "summary", **metrics, "bytes_sent_per_step": total_sent / args.steps, "dense_bytes": dense_bytes})
    if log is not None:
        log.close()
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
