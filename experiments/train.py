"""DDP training runner: one workload, one gradient-communication method, N ranks.

Runs over Gloo on CPU (NCCL when CUDA is available). It either spawns ``--nproc`` local
ranks itself, or, when launched by ``torchrun`` (``RANK``/``WORLD_SIZE`` set), runs as
one of torchrun's ranks.

Methods (``--compressor``): the table in :mod:`experiments.catalog`, which ``--help``
prints. gradcomp's methods build their compressor from the registry:
``from_spec("topk:<--density>")``, ``from_spec("twobit:<--threshold>")``.

Timing. ``step_time_s`` is the wall time, on rank 0, of zero_grad + forward + backward +
optimizer step. DDP waits for every bucket's communication future at the end of
backward, so the collective has completed inside that window (with CUDA the device is
synchronised before reading the clock). Data loading, logging and evaluation are outside
it. ``train_time_s`` is the running sum of step times: the x axis of loss-vs-time plots.

Breakdown. One run cannot separate computation from communication that overlaps it, so
the split is made across runs (see ``experiments.compare``): ``compute`` is the median step time of
the ``noop`` run on the same workload and link; ``compress_s`` is measured here, per step,
as the time on the calling thread inside the compression hook (gradcomp's own
``state.stats()`` for top-k/2-bit, a timer around torch's hook for fp16/PowerSGD; 0 for
dense); communication is the rest (exposed communication, decompression and waiting).

Bytes. ``bytes_sent`` is what this rank handed to collectives in the step (allreduce:
the buffer; allgather: its own payload), ``dense_bytes`` what a dense fp32 allreduce
would hand over. With 2 ranks both equal the bytes each rank actually puts on the wire
(a ring allreduce sends ``2 (P-1)/P`` buffers, an allgather ``(P-1)`` payloads). Inside a
private network namespace (``experiments.netem``) ``wire_bytes`` is also measured: the growth of
the namespace loopback's ``tx_bytes`` during the step, divided by the world size.

Log (``--log``, JSON lines, rank 0): one ``{"event": "config", ...}`` line, one
``{"event": "step", ...}`` per step, ``{"event": "eval", ...}`` lines, and a final
``{"event": "summary", ...}``.

Examples (from the repository root)::

    python -m experiments.train --workload charlm --compressor topk --density 0.01 \\
        --steps 50 --log results/topk.jsonl
    torchrun --nproc-per-node 2 -m experiments.train --workload digits --compressor twobit
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import warnings

from experiments.catalog import METHODS
from experiments.launch import NETNS_ENV, lo_tx_bytes, parse_args, set_thread_env, spawn
from experiments.methods import (
    GRADCOMP_WARMUP_STEPS,
    attach_method,
    choose_twobit_threshold,
    compressor_for,
    initial_twobit_threshold,
    warm_up_kernels,
)


def run_rank(rank: int, world_size: int, local_rank: int, args: argparse.Namespace) -> None:
    """Train on this rank; rank 0 logs. The process group is set up from the environment
    (``MASTER_ADDR``/``MASTER_PORT``) and destroyed at the end."""
    import torch.distributed as dist

    device, backend = _init_rank(rank, world_size, local_rank, args)
    log = open(args.log, "w") if (rank == 0 and args.log) else None
    try:
        run = _Run(rank, world_size, local_rank, device, args, log)
        run.emit_config(backend)
        run.train()
        dist.barrier()
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()


def _init_rank(rank: int, world_size: int, local_rank: int, args: argparse.Namespace):
    """Threads, device and process group of this rank; ``(device, process group backend)``."""
    from experiments import netem

    netem.join_rank_namespace(rank)  # a full-duplex emulated link: this rank's own namespace (else nothing)
    set_thread_env(args.threads)
    import torch
    import torch.distributed as dist

    # A 1-channel conv's weight grad may get strides that differ from its bucket view;
    # DDP copies it correctly and warns once per rank, which is only noise here.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout))
    return device, backend


class _Run:
    """One rank's run: the workload, the DDP model, the optimizer and its LR schedule, the method."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device, args: argparse.Namespace, log):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        from experiments import workloads

        self.rank, self.world_size, self.device, self.args, self.log = rank, world_size, device, args, log
        overrides = {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "context": args.context}
        self.workload = workloads.build_workload(args.workload, seed=args.seed, small=args.small,
                                                 charlm_overrides=overrides, eval_windows=args.eval_windows)
        self.batch_size = args.batch_size or self.workload.default_batch_size
        self.lr = args.lr or (self.workload.default_lr if args.optimizer == "adamw" else 0.1)
        self.lr_warmup = args.lr_warmup if args.lr_warmup is not None else min(20, args.steps // 10)
        self.net = self.workload.build_model().to(device)
        self.params = sum(p.numel() for p in self.net.parameters())
        self.dense_bytes = sum(p.numel() * p.element_size() for p in self.net.parameters() if p.requires_grad)
        cuda = device.type == "cuda"
        self.model = DistributedDataParallel(self.net, device_ids=[local_rank] if cuda else None)
        if args.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        else:
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: self.lr_at(step) / self.lr)
        self.telemetry = attach_method(self.model, args.compressor, args, self.dense_bytes, self.optimizer,
                                       self.scheduler)
        self.kernel_warmup_s = 0.0
        if self.telemetry.gradcomp_state is not None:
            self.kernel_warmup_s = warm_up_kernels(self.telemetry.gradcomp_state.engine.compressor, args.backend,
                                                   device)
        self.threshold = initial_twobit_threshold(args.threshold)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak at the last step."""
        if step < self.lr_warmup:
            return self.lr * (step + 1) / self.lr_warmup
        progress = (step - self.lr_warmup) / max(1, self.args.steps - self.lr_warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    def emit(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def evaluate(self, step: int, train_time: float) -> dict:
        """Held-out metrics summed over the ranks (every rank takes part); logged, returned."""
        import torch.distributed as dist

        from gradcomp import inflight

        self.net.eval()
        sums = self.workload.evaluate_sums(self.net, self.rank, self.world_size, self.device)
        self.net.train()
        (handed,) = inflight.hold(sums)  # Gloo's thread must not be the last owner of a Python tensor at exit
        dist.all_reduce(handed)
        metrics = self.workload.metrics(sums.cpu())
        self.emit({"event": "eval", "step": step, "train_time_s": train_time, **metrics})
        return metrics

    def emit_config(self, backend: str) -> None:
        import torch

        self.emit({"event": "config", **vars(self.args), **self.workload.describe(), "params": self.params,
                   "dense_bytes": self.dense_bytes, "kernel_warmup_s": self.kernel_warmup_s,
                   "world_size": self.world_size, "process_group_backend": backend, "device": str(self.device),
                   "batch_size": self.batch_size, "lr": self.lr, "lr_warmup": self.lr_warmup,
                   "netns": os.environ.get(NETNS_ENV), "link": os.environ.get("GRADCOMP_LINK", "unknown"),
                   "torch": torch.__version__, "hostname": socket.gethostname()})

    def step(self, step: int, train_time: float) -> dict:
        """One timed optimizer step; its log record (``train_time_s`` includes it)."""
        import torch

        x, y = self.workload.batch(self.rank, step, self.batch_size)
        x, y = x.to(self.device), y.to(self.device)
        tx_before = lo_tx_bytes()
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.workload.loss(self.model, x, y)
        loss.backward()  # returns once every bucket's collective has completed
        self.optimizer.step()
        self.scheduler.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_time = time.perf_counter() - started
        tx_after = lo_tx_bytes()
        comm = self.telemetry.end_step()
        record = {"event": "step", "step": step, "loss": float(loss.detach()), "step_time_s": step_time,
                  "train_time_s": train_time + step_time, "lr": self.lr_at(step), **comm}
        if tx_before is not None and tx_after is not None:
            record["wire_bytes"] = (tx_after - tx_before) / self.world_size
        return record

    def choose_threshold(self, step: int) -> None:
        """``--threshold auto`` for the plain 2-bit methods: set at the last dense warm-up step."""
        args = self.args
        if (args.compressor.startswith("twobit") and args.threshold == "auto" and step == GRADCOMP_WARMUP_STEPS - 1
                and not METHODS[args.compressor].recipe):
            self.threshold = choose_twobit_threshold(self.net, args.threshold_scale)
            # The engine asks for its base compressor anew at every step: from the next one on
            # it compresses with the chosen threshold.
            self.telemetry.gradcomp_state.engine.compressor = compressor_for(METHODS[args.compressor], args,
                                                                            self.threshold)
            self.emit({"event": "threshold", "step": step, "threshold": self.threshold,
                       "scale": args.threshold_scale})

    def train(self) -> None:
        """``args.steps`` steps with evaluations, then the final evaluation and the summary."""
        args, progress = self.args, None
        if self.rank == 0 and not args.no_progress:
            from tqdm import tqdm

            progress = tqdm(total=args.steps, desc=f"{args.workload}/{args.compressor}", unit="step", file=sys.stderr)
        train_time, step_times, losses = 0.0, [], []
        for step in range(args.steps):
            record = self.step(step, train_time)
            train_time = record["train_time_s"]
            step_times.append(record["step_time_s"])
            losses.append(record["loss"])
            self.emit(record)
            if progress is not None:
                progress.set_postfix(loss=f"{record['loss']:.3f}", step_s=f"{record['step_time_s']:.3f}")
                progress.update()
            self.choose_threshold(step)
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                self.evaluate(step, train_time)
        if progress is not None:
            progress.close()
        self.summarize(self.evaluate(args.steps - 1, train_time), train_time, step_times, losses)

    def summarize(self, final: dict, train_time: float, step_times: list, losses: list) -> None:
        args = self.args
        timed = step_times[min(len(step_times) - 1, GRADCOMP_WARMUP_STEPS + 2) :]
        summary = {"event": "summary", "workload": args.workload, "method": args.compressor, "steps": args.steps,
                   "params": self.params, "median_step_time_s": statistics.median(timed), "train_time_s": train_time,
                   "final_train_loss": statistics.fmean(losses[-max(1, min(10, len(losses) // 5)) :]),
                   "twobit_threshold": self.threshold if args.compressor.startswith("twobit") else None, **final}
        self.emit(summary)
        if self.rank == 0:
            print(json.dumps(summary), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    set_thread_env(args.threads)
    if args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), args)
        return 0
    return spawn(args, run_rank)


if __name__ == "__main__":
    sys.exit(main())
