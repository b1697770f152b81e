"""The convergence study's real-DDP runs (:mod:`experiments.convergence`): one run's ranks over Gloo.

The study runs torch's hooks (``fp16``, ``powersgd``) and ``auto`` (which measures a link) as real
DDP, 2 ranks x 1 thread, on the shaped link; the study starts each run as
``python -m experiments.convergence --worker SPEC --log PATH`` inside the link, which calls
:func:`run_worker`. It spawns the local ranks; each (:func:`run_rank`) builds the workload and its
loop (:mod:`experiments.suite`, :mod:`experiments.loop`), wraps the model in DDP with its default
buckets, registers the method (:func:`attach`), trains with the workload's own loop (:func:`_ddp_step`,
also the step that :mod:`experiments.step_times` times) and evaluates held-out metrics over every rank
(:func:`_held_out`); rank 0 writes the run's JSON-lines log, the same kinds of record (``config``,
``step``, ``eval``, ``done``) as the simulated runs' (:mod:`experiments.simrun`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Dict, Optional

if TYPE_CHECKING:
    from experiments.convergence import RunSpec

TOPK_DENSITY = 0.01
#: How the runs bucket their gradients (recorded in every row): DDP's default buckets.
BUCKETS = "default"


def _build_workload(name: str, seed: int, eval_windows: int):
    from experiments import suite

    return suite.build(name, seed, eval_windows)


class _TorchHookTelemetry:
    """Bytes per step for DDP's allreduce and torch's hooks (through ``methods.attach_method``)."""

    def __init__(self, telemetry):
        self.telemetry = telemetry

    def end_step(self) -> Dict[str, int]:
        out = self.telemetry.end_step()
        return {"bytes_sent": int(out["bytes_sent"]), "dense_bytes": int(out["dense_bytes"])}


class _GradcompTelemetry:
    def __init__(self, state):
        self.state = state

    def end_step(self) -> Dict[str, int]:
        last = self.state.stats()["last_step"]
        return {"bytes_sent": int(last["bytes_sent"]), "dense_bytes": int(last["dense_bytes"])}


def attach(model, net, spec: RunSpec, loop):
    """Build the workload's optimizer (as its script does) and register ``spec.method`` on the DDP
    ``model``; returns ``(optimizer, scheduler or None, telemetry)``."""
    import gradcomp
    from experiments import loop as loops
    from experiments import methods
    from gradcomp.hooks import ddp as gradcomp_ddp

    optimizer, scheduler = loops.build_optimizer(loop, model)
    dense_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    if spec.method in ("dense", "fp16", "powersgd"):
        args = argparse.Namespace(seed=spec.seed, density=TOPK_DENSITY, threshold="chunk", backend=None)
        return optimizer, scheduler, _TorchHookTelemetry(methods.attach_method(model, spec.method, args, dense_bytes))
    base, _, variant = spec.method.partition("-")
    spec_text = "twobit:chunk" if base == "twobit" else f"topk:{TOPK_DENSITY}"
    if variant == "plain":
        state = gradcomp_ddp.register(model, spec_text, warmup_steps=2)
    else:
        kwargs = {"error_feedback": variant != "noef"}
        if base == "auto":
            kwargs["policy"] = gradcomp.Auto()
        state = gradcomp_ddp.register(model, spec_text, optimizer=optimizer, total_steps=spec.steps,
                                      scheduler=scheduler, **kwargs)
    return optimizer, scheduler, _GradcompTelemetry(state)


def _ddp_step(ddp, net, workload, loop, optimizer, scheduler, rank: int, step: int) -> float:
    """One optimizer step of the workload's loop on a DDP rank (accumulation under ``no_sync``)."""
    import contextlib

    from experiments import loop as loops

    if loop.manual_lr:
        loops.set_lr(loop, optimizer, step)
    micro, losses = loop.accumulation, []
    for m in range(micro):
        x, y = workload.batch(rank, step * micro + m, workload.default_batch_size)
        with ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
            loss = workload.loss(ddp, x, y)
            (loss / micro).backward()
        losses.append(float(loss.detach()))
    loops.before_step(loop, net, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return sum(losses) / micro


def _held_out(net, workload, rank: int, world_size: int) -> dict:
    """The workload's held-out metrics, summed over every rank (each evaluates its share)."""
    import torch
    import torch.distributed as dist

    from gradcomp import inflight

    net.eval()
    sums = workload.evaluate_sums(net, rank, world_size, torch.device("cpu"))
    net.train()
    (handed,) = inflight.hold(sums)  # Gloo's thread must not be the last owner of a Python tensor at exit
    dist.all_reduce(handed)
    return workload.metrics(sums)


def run_rank(rank: int, world_size: int, spec: RunSpec, log_path: Optional[str], timeout_s: float) -> None:
    """Train ``spec`` on this rank (the process group comes from ``MASTER_ADDR/PORT``); rank 0
    writes the JSON-lines log."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = "1"
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    log = open(log_path, "w") if (rank == 0 and log_path) else None
    try:
        workload = _build_workload(spec.workload, spec.seed, spec.eval_windows)
        net = workload.build_model()
        # DDP's default buckets, as a user has them: the engine compresses each parameter of a
        # bucket on its own (its own top-k budget and 2-bit scale).
        model = DistributedDataParallel(net)
        from experiments import loop as loops

        loop = loops.loop_for(spec.workload, spec.optimizer, spec.steps)
        optimizer, scheduler, telemetry = attach(model, net, spec, loop)
        batch_size = workload.default_batch_size

        def emit(record: dict) -> None:
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()

        def evaluate(step: int, train_time: float) -> None:
            emit({"event": "eval", "step": step, "train_time_s": train_time,
                  **_held_out(net, workload, rank, world_size)})

        emit({"event": "config", **asdict(spec), "buckets": BUCKETS, "engine": "ddp", "loop": loop.describe(),
              "world_size": world_size, "batch_size": batch_size,
              "link": os.environ.get("GRADCOMP_LINK", "unshaped"), "torch": torch.__version__,
              "params": sum(p.numel() for p in net.parameters())})  # fmt: skip
        evaluate(-1, 0.0)
        train_time = 0.0
        for step in range(spec.steps):
            started = time.perf_counter()
            loss = _ddp_step(model, net, workload, loop, optimizer, scheduler, rank, step)
            step_time = time.perf_counter() - started
            train_time += step_time
            emit({"event": "step", "step": step, "loss": loss, "step_time_s": step_time,
                  "train_time_s": train_time, **telemetry.end_step()})  # fmt: skip
            if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
                evaluate(step, train_time)
        emit({"event": "done", "steps": spec.steps, "train_time_s": train_time})
        dist.barrier()
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()


def run_worker(spec: RunSpec, log_path: str, nproc: int, timeout_s: float) -> int:
    """Spawn ``nproc`` local ranks of ``spec``; the exit status (0 when every rank succeeded)."""
    import multiprocessing

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from experiments.launch import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(r, nproc, spec, log_path, 300.0)) for r in range(nproc)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        processes[0].join(timeout=0.5)
    status = 0
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=10)
            status = status or 124
        status = status or (process.exitcode or 0)
    return status
