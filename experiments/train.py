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

The ranks are :func:`experiments.runner.run_rank` with :class:`TrainRun`, started by
:func:`experiments.launch.spawn`; this module is a script, which no other module imports.

Examples (from the repository root)::

    python -m experiments.train --workload charlm --compressor topk --density 0.01 \\
        --steps 50 --log results/topk.jsonl
    torchrun --nproc-per-node 2 -m experiments.train --workload digits --compressor twobit
"""
from __future__ import annotations

import json
import os
import socket
import sys

from experiments.catalog import METHODS
from experiments.launch import NETNS_ENV, parse_args, set_thread_env, spawn
from experiments.methods import (
    GRADCOMP_WARMUP_STEPS,
    attach_method,
    choose_twobit_threshold,
    compressor_for,
    initial_twobit_threshold,
    warm_up_kernels,
)
from experiments.runner import Run, run_rank, timing_summary


class TrainRun(Run):
    """A run of ``experiments.train``: its command line's workload and loop under DDP, any method of
    the catalog, NCCL where there are GPUs, a progress bar; no evaluation before the first step."""

    cuda = True
    eval_at_start = False
    done_record = False

    def attach(self):
        args = self.args
        self.params = sum(p.numel() for p in self.net.parameters())
        self.dense_bytes = sum(p.numel() * p.element_size() for p in self.net.parameters() if p.requires_grad)
        telemetry = attach_method(self.model, args.compressor, args, self.dense_bytes, self.optimizer,
                                  self.scheduler)
        self.kernel_warmup_s = 0.0
        if telemetry.gradcomp_state is not None:
            self.kernel_warmup_s = warm_up_kernels(telemetry.gradcomp_state.engine.compressor, args.backend,
                                                   self.device)
        self.threshold = initial_twobit_threshold(args.threshold)
        return telemetry

    def config(self, backend: str) -> dict:
        import torch

        return {**vars(self.args), **self.workload.describe(), "params": self.params,
                "dense_bytes": self.dense_bytes, "kernel_warmup_s": self.kernel_warmup_s,
                "world_size": self.world_size, "process_group_backend": backend, "device": str(self.device),
                "batch_size": self.batch_size, "lr": self.loop.lr, "lr_warmup": self.loop.warmup,
                "netns": os.environ.get(NETNS_ENV), "link": os.environ.get("GRADCOMP_LINK", "unknown"),
                "torch": torch.__version__, "hostname": socket.gethostname()}

    def step_fields(self, step: int) -> dict:
        from experiments import loop as loops

        return {"lr": loops.lr_at(self.loop, step)}

    def progress(self):
        if self.rank != 0 or self.args.no_progress:
            return None
        from tqdm import tqdm

        args = self.args
        return tqdm(total=args.steps, desc=f"{args.workload}/{args.compressor}", unit="step", file=sys.stderr)

    def after_step(self, step: int) -> None:
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

    def summarize(self, final: dict, train_time: float, step_times: list, losses: list) -> None:
        args = self.args
        summary = {"event": "summary", "workload": args.workload, "method": args.compressor, "steps": args.steps,
                   "params": self.params, **timing_summary(train_time, step_times, losses),
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
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), TrainRun, args,
                 int(os.environ.get("LOCAL_RANK", 0)))
        return 0
    return spawn(args, run_rank, TrainRun)


if __name__ == "__main__":
    sys.exit(main())
