"""One rank of a training run: the per-rank loop of every training experiment.

:func:`run_rank` is what :func:`experiments.launch.spawn` starts on each rank (or torchrun, through
``experiments.train``; horovodrun, through ``experiments.horovod_train``): it joins the rank's
network namespace, sets the threads and initialises the process group (:meth:`Run.join_group`:
:func:`experiments.launch.init_rank`), builds a :class:`Run` and trains it. A :class:`Run` builds
the workload and its loop (:mod:`experiments.suite` for a study's named workload,
:mod:`experiments.workloads` for ``experiments.train``'s command line; :mod:`experiments.loop` for
the optimizer, its learning rate and the step), wraps the model, attaches the method, then steps,
evaluates and logs (rank 0, JSON lines).

Each script states where its runs differ by a small subclass: :class:`experiments.train.TrainRun`
(DDP, any method of the catalog, a progress bar), ``experiments.convergence_ddp.StudyRun`` (DDP, the
convergence study's methods), ``experiments.fsdp_train.FsdpRun`` (every block under
``fully_shard``), ``experiments.exit_codes.StressRun`` (the clean-exit stress job's own model, data
and optimizer) and ``experiments.horovod_train.HorovodRun`` (Horovod's ranks and exchange). The
hooks: :meth:`Run.join_group`, :meth:`Run.leave_group`, :meth:`Run.build_workload`,
:meth:`Run.build_optimizer`, :meth:`Run.wrap`, :meth:`Run.attach`, :meth:`Run.config`,
:meth:`Run.step_fields`, :meth:`Run.after_step`, :meth:`Run.held_out_sums`, :meth:`Run.summarize`,
and the flags ``cuda``, ``eval_at_start``, ``wire_bytes``, ``done_record``.

Records: ``{"event": "config"}`` (the subclass's), one ``{"event": "step"}`` per optimizer step
(``loss``, ``step_time_s``: the wall time of the step without drawing its batches, ``train_time_s``:
their running sum, then the subclass's fields, the method's bytes, and ``wire_bytes`` inside a private
namespace), ``{"event": "eval"}`` lines (held-out metrics), then the subclass's summary and, where
``done_record``, ``{"event": "done"}``.

torch is imported inside the functions only: the launching process, which imports this module to
name the rank function, never loads it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import warnings
from typing import List, Optional

from experiments import launch

__all__ = ["run_rank", "Run", "timing_summary"]


def run_rank(rank: int, world_size: int, run_class: type, args: argparse.Namespace,
             local_rank: Optional[int] = None) -> None:
    """Train ``run_class(rank, world_size, device, args, log)`` on this rank; rank 0 logs to ``args.log``.
    ``args`` carries at least ``threads``, ``timeout`` (seconds), ``log`` and ``eval_every``. The rank
    joins its process group by ``run_class.join_group`` (by default from ``MASTER_ADDR``/``MASTER_PORT``)
    and leaves it by ``run_class.leave_group``, also when the run fails."""
    from experiments import netem

    netem.join_rank_namespace(rank)  # a full-duplex emulated link: this rank's own namespace (else nothing)
    # A 1-channel conv's weight grad may get strides that differ from its bucket view;
    # DDP copies it correctly and warns once per rank, which is only noise here.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    device, backend = run_class.join_group(rank, world_size, args, local_rank)
    log = open(args.log, "w") if (rank == 0 and args.log) else None
    finished = False
    try:
        run = run_class(rank, world_size, device, args, log)
        run.emit({"event": "config", **run.config(backend)})
        run.train()
        finished = True
    finally:
        if log is not None:
            log.close()
        run_class.leave_group(finished)


def workload_and_loop(args: argparse.Namespace):
    """``(workload, loop)``: a study's named workload and its own loop (``args.suite_spec``, a
    :class:`experiments.convergence.RunSpec` as a dict), else ``experiments.train``'s arguments."""
    from experiments import loop as loops
    from experiments import suite, workloads

    spec = getattr(args, "suite_spec", None)
    if spec is not None:
        return (suite.build(spec["workload"], spec["seed"], spec["eval_windows"]),
                loops.loop_for(spec["workload"], spec["optimizer"], spec["steps"]))
    overrides = {"d_model": args.d_model, "layers": args.layers, "heads": args.heads, "context": args.context}
    workload = workloads.build_workload(args.workload, seed=args.seed, small=args.small, charlm_overrides=overrides,
                                        eval_windows=args.eval_windows)
    optimizer = "adamw" if args.optimizer == "adamw" else "sgdm"
    lr = args.lr or (workload.default_lr if optimizer == "adamw" else 0.1)
    warmup = args.lr_warmup if args.lr_warmup is not None else min(20, args.steps // 10)
    return workload, loops.Loop(optimizer, lr, args.steps, warmup)


def timing_summary(train_time: float, step_times: List[float], losses: List[float]) -> dict:
    """The summary's timing and loss: the median step time after the first four (the dense start and
    the kernels' first calls), the train time, the mean loss of the last fifth (at most 10 steps)."""
    return {"median_step_time_s": statistics.median(step_times[min(len(step_times) - 1, 4):]),
            "train_time_s": train_time,
            "final_train_loss": statistics.fmean(losses[-max(1, min(10, len(losses) // 5)):])}


class Run:
    """One rank's run: the workload and its loop, the wrapped model, the optimizer, the method.

    Subclasses state where their runs differ (the module docstring); every attribute the hooks read
    is set here: ``workload``, ``loop``, ``batch_size``, ``net`` (the model), ``model`` (wrapped),
    ``optimizer``, ``scheduler``, ``telemetry`` (``end_step() -> dict`` of the step's bytes).
    """

    cuda = False  # NCCL on this rank's GPU where there is one; else Gloo on the CPU
    eval_at_start = True  # a held-out evaluation (step -1) before the first step
    wire_bytes = True  # inside a private namespace: the loopback's bytes sent per step
    done_record = True  # a final {"event": "done"}

    def __init__(self, rank: int, world_size: int, device, args: argparse.Namespace, log):
        self.rank, self.world_size, self.device, self.args, self.log = rank, world_size, device, args, log
        self.workload, self.loop = self.build_workload()
        self.batch_size = getattr(args, "batch_size", None) or self.workload.default_batch_size
        self.eval_every = args.eval_every
        self.net = self.workload.build_model().to(device)
        self.model = self.wrap(self.net)
        self.optimizer, self.scheduler = self.build_optimizer()
        self.telemetry = self.attach()

    # -- the hooks --------------------------------------------------------------------------------
    @classmethod
    def join_group(cls, rank: int, world_size: int, args: argparse.Namespace, local_rank: Optional[int]):
        """Before the run is built: the rank's thread counts (``args.threads``), its device and the
        process group (:func:`experiments.launch.init_rank`); ``(device, backend name)``."""
        launch.set_thread_env(args.threads)
        return launch.init_rank(rank, world_size, args.threads, args.timeout, local_rank, cls.cuda)

    @classmethod
    def leave_group(cls, finished: bool) -> None:
        """At the end, also after a failure: wait for every rank where the run ``finished``, then destroy
        the process group."""
        import torch.distributed as dist

        try:
            if finished:
                dist.barrier()
        finally:
            dist.destroy_process_group()

    def build_workload(self):
        """``(workload, loop)``: :func:`workload_and_loop` of the run's arguments."""
        return workload_and_loop(self.args)

    def build_optimizer(self):
        """``(optimizer, scheduler or None)`` of ``self.model``: the loop's
        (:func:`experiments.loop.build_optimizer`)."""
        from experiments import loop as loops

        return loops.build_optimizer(self.loop, self.model)

    def wrap(self, net):
        """The model the loop trains: ``net`` under DDP (its default buckets)."""
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(net, device_ids=[self.device.index] if self.device.type == "cuda" else None)

    def attach(self):
        """Install the method on ``self.model``; its telemetry."""
        raise NotImplementedError

    def config(self, backend: str) -> dict:
        """The config record's fields."""
        raise NotImplementedError

    def step_fields(self, step: int) -> dict:
        """Fields of a step record before the method's bytes."""
        return {}

    def after_step(self, step: int) -> None:
        """What the run does after a step's record (and before an evaluation)."""

    def held_out_sums(self):
        """The workload's held-out sums: each rank evaluates its share, summed over the ranks."""
        import torch.distributed as dist

        from gradcomp import inflight

        sums = self.workload.evaluate_sums(self.net, self.rank, self.world_size, self.device)
        (handed,) = inflight.hold(sums)  # Gloo's thread must not be the last owner of a Python tensor at exit
        dist.all_reduce(handed)
        return sums.cpu()

    def summarize(self, final: dict, train_time: float, step_times: List[float], losses: List[float]) -> None:
        """What the run logs after its final evaluation (nothing by default)."""

    # -- the loop ---------------------------------------------------------------------------------
    def emit(self, record: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()

    def evaluate(self, step: int, train_time: float) -> dict:
        """Held-out metrics (every rank takes part); logged, returned."""
        self.net.eval()
        sums = self.held_out_sums()
        self.net.train()
        metrics = self.workload.metrics(sums)
        self.emit({"event": "eval", "step": step, "train_time_s": train_time, **metrics})
        return metrics

    def progress(self):
        """A progress bar of the steps (``update``, ``set_postfix``, ``close``), or ``None``."""
        return None

    def step(self, step: int, train_time: float) -> dict:
        """One timed optimizer step; its log record (``train_time_s`` includes it)."""
        from experiments import loop as loops

        batches = loops.micro_batches(self.workload, self.loop, self.rank, step, self.batch_size, self.device)
        tx_before = launch.lo_tx_bytes() if self.wire_bytes else None
        loss, step_time = loops.timed_optimizer_step(self.model, self.workload, self.loop, self.optimizer,
                                                     self.scheduler, batches, step, self.device)
        tx_after = launch.lo_tx_bytes() if self.wire_bytes else None
        record = {"event": "step", "step": step, "loss": loss, "step_time_s": step_time,
                  "train_time_s": train_time + step_time, **self.step_fields(step), **self.telemetry.end_step()}
        if tx_before is not None and tx_after is not None:
            record["wire_bytes"] = (tx_after - tx_before) / self.world_size
        return record

    def train(self) -> None:
        """Every step of the loop, with evaluations (at the start, every ``eval_every`` steps, at the end),
        then the summary."""
        steps = self.loop.steps
        if self.eval_at_start:
            self.evaluate(-1, 0.0)
        progress = self.progress()
        train_time, step_times, losses = 0.0, [], []
        for step in range(steps):
            record = self.step(step, train_time)
            train_time = record["train_time_s"]
            step_times.append(record["step_time_s"])
            losses.append(record["loss"])
            self.emit(record)
            if progress is not None:
                progress.set_postfix(loss=f"{record['loss']:.3f}", step_s=f"{record['step_time_s']:.3f}")
                progress.update()
            self.after_step(step)
            if self.eval_every and (step + 1) % self.eval_every == 0 and step + 1 < steps:
                self.evaluate(step, train_time)
        if progress is not None:
            progress.close()
        self.summarize(self.evaluate(steps - 1, train_time), train_time, step_times, losses)
        if self.done_record:
            self.emit({"event": "done", "steps": steps, "train_time_s": train_time})
