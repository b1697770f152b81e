"""One run of the convergence study in the in-process simulation of the ranks.

:func:`run` trains a :class:`~experiments.convergence.RunSpec` on ``world_size`` simulated ranks
(:mod:`experiments.simulate`: the engine's own compress, exchange, average and stage, bitwise the
real 2-rank DDP run) with the workload's own loop (:mod:`experiments.loop`: its optimizer, its
learning rate set by a scheduler or by hand, clipping, accumulation), gradcomp set up by the one
set-up every integration uses (:func:`gradcomp.setup.prepare`), and writes the study's JSON-lines
log: a ``config`` record, a ``step`` record per step (rank 0's loss, the bytes rank 0 handed to
collectives and what dense would have handed), an ``eval`` record every ``eval_every`` steps
(held-out metrics of rank 0's replica, which every rank holds bitwise) and ``done``.

Methods: ``dense`` (DDP's allreduce), ``topk`` (``"topk:0.01"``) and ``twobit`` (``"twobit:chunk"``)
through the recipe (``threebit``: ``"threebit"``, the code the recipe gives 2-bit under SGD and
Adam, under any optimizer), ``*-noef`` the same without error feedback, ``*-plain`` error feedback into the
user's optimizer without the recipe (2 dense steps), as ``register(model, spec)`` alone does.
Step times in these logs are the simulation's compute per rank and say nothing of a link.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict
from typing import Optional, Tuple

import torch

from experiments import fingerprint

__all__ = ["run", "SIMULATED_METHODS", "SPECS"]

SPECS = {"topk": "topk:0.01", "twobit": "twobit:chunk", "threebit": "threebit"}
SIMULATED_METHODS = ("dense", "topk", "twobit", "threebit", "topk-noef", "twobit-noef", "topk-plain", "twobit-plain")


def _attach(spec, schedulers):
    """``attach(rank, replica, optimizer, transport) -> Engine`` for ``spec.method`` (``None``: dense)."""
    from gradcomp.engine import Engine
    from gradcomp.setup import prepare

    if spec.method == "dense":
        return None
    base, _, variant = spec.method.partition("-")

    def attach(rank, replica, optimizer, transport):
        named = replica.named_parameters()
        if variant == "plain":
            setup = prepare(SPECS[base], named, warmup_steps=2, announce=False)
        else:
            setup = prepare(SPECS[base], named, optimizer=optimizer, total_steps=spec.steps,
                            scheduler=schedulers[id(optimizer)], error_feedback=variant != "noef",
                            announce=rank == 0)
        return Engine(setup.compressor, transport, **setup.settings)

    return attach


def _loss_fn(workload, scale: float):
    return lambda model, x, y: workload.loss(model, x, y) * scale


def run(spec, log_path: str, world_size: int = 2) -> None:
    """Train ``spec`` in the simulation and write its log to ``log_path`` (see the module docstring)."""
    from experiments import loop as loops
    from experiments import suite
    from experiments.simulate import Simulation

    workload = suite.build(spec.workload, spec.seed, spec.eval_windows)
    loop = loops.loop_for(spec.workload, spec.optimizer, spec.steps)
    schedulers = {}

    def make_optimizer(replica):
        optimizer, scheduler = loops.build_optimizer(loop, replica)
        schedulers[id(optimizer)] = scheduler
        return optimizer

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        sim = Simulation(workload.build_model(), make_optimizer, _attach(spec, schedulers), world_size)
    dense_bytes = sum(p.numel() * p.element_size() for p in sim.replicas[0].parameters() if p.requires_grad)
    with open(log_path, "w") as log:
        def emit(record: dict) -> None:
            log.write(json.dumps(record) + "\n")
            log.flush()

        emit({"event": "config", **asdict(spec), "engine": "simulation", "buckets": "default",
              "code": fingerprint.code(), "machine": fingerprint.machine(),
              "world_size": world_size, "batch_size": workload.default_batch_size,
              "loop": loop.describe(), "torch": torch.__version__, "link": None,
              "params": sum(p.numel() for p in sim.replicas[0].parameters())})
        _evaluate(sim, workload, -1, 0.0, emit)
        train_time = 0.0
        for step in range(spec.steps):
            started = time.perf_counter()
            loss, grad_norm = _train_step(sim, workload, loop, step, schedulers)
            step_time = (time.perf_counter() - started) / world_size
            train_time += step_time
            engine = sim.engines[0]
            last = engine.stats()["last_step"] if engine is not None else {"bytes_sent": dense_bytes,
                                                                           "dense_bytes": dense_bytes}
            emit({"event": "step", "step": step, "loss": loss, "step_time_s": step_time, "train_time_s": train_time,
                  "bytes_sent": int(last["bytes_sent"]), "dense_bytes": int(last["dense_bytes"]),
                  **({} if grad_norm is None else {"grad_norm": grad_norm})})
            if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
                _evaluate(sim, workload, step, train_time, emit)
        emit({"event": "done", "steps": spec.steps, "train_time_s": train_time})


def _train_step(sim, workload, loop, step: int, schedulers) -> Tuple[float, Optional[float]]:
    """One optimizer step of every simulated rank, as the workload's loop does it: rank 0's loss and
    the gradient norm rank 0's clip measured (``None`` without a clip)."""
    from experiments import loop as loops

    if loop.manual_lr:
        for optimizer in sim.optimizers:
            loops.set_lr(loop, optimizer, step)
    micro = loop.accumulation
    losses = []
    for m in range(micro):
        batches = [workload.batch(r, step * micro + m, workload.default_batch_size) for r in range(sim.world_size)]
        losses.append(sim.backward(batches, workload.loss, sync=m == micro - 1, scale=1.0 / micro)[0])
    norms = []
    for replica, optimizer in zip(sim.replicas, sim.optimizers):
        norms.append(loops.before_step(loop, replica, optimizer))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if schedulers[id(optimizer)] is not None:
            schedulers[id(optimizer)].step()
    return sum(losses) / micro, norms[0]


@torch.no_grad()
def _evaluate(sim, workload, step: int, train_time: float, emit) -> None:
    net = sim.replicas[0]
    net.eval()
    sums = workload.evaluate_sums(net, 0, 1, torch.device("cpu"))
    net.train()
    emit({"event": "eval", "step": step, "train_time_s": train_time, **workload.metrics(sums)})


def main(argv=None) -> int:
    """``python -m experiments.simrun SPEC_JSON LOG``: one run (one thread)."""
    import sys

    from experiments.convergence import RunSpec

    args = sys.argv[1:] if argv is None else argv
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    torch.set_num_threads(1)
    run(RunSpec(**json.loads(args[0])), args[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
