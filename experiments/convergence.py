"""The convergence study: does compressed training reach the dense held-out loss, on models of
different kinds, with the workloads' own training loops?

Runs of gradcomp's methods and of dense DDP go through the in-process simulation of the ranks
(:mod:`experiments.simrun`: the engine's own compress, exchange, average and stage on 2 ranks,
bitwise the real DDP run over Gloo, ``tests/test_grad_contract.py``), so that the study takes hours,
not days, on two cores: ``--jobs`` runs at once, one thread each. torch's hooks (``fp16``,
``powersgd``) and ``auto`` (which measures a link) run real DDP over Gloo, 2 ranks x 1 thread, on the
shaped link ``--link`` (``netem.py``). Every run uses DDP's default buckets (``"buckets"`` in its row).

Methods (``method`` in the rows):

================  =============================================================================
``dense``         DDP's built-in allreduce, fp32
``topk``          the one-call recipe, ``register(model, "topk:0.01", optimizer=, total_steps=,
                  scheduler=)`` (:mod:`gradcomp.recipe`)
``twobit``        the same call with ``"twobit:chunk"``
``topk-noef``     the ``topk`` recipe with error feedback off (and ``twobit-noef``)
``topk-plain``    error feedback into the user's optimizer without the recipe, 2 dense steps, as
                  ``register(model, "topk:0.01")`` alone does (and ``twobit-plain``)
``fp16``          torch's ``fp16_compress_hook`` (real DDP)
``powersgd``      torch's PowerSGD hook, rank 4, error feedback, 2 dense steps (real DDP)
``auto``          the top-k recipe with ``policy=gradcomp.Auto()`` (real DDP)
================  =============================================================================

Workloads and their loops are :mod:`experiments.suite` and :mod:`experiments.loop`: charlm-small
(transformer, 2000 steps), proselm (GRU, 600), digits-mlp (MLP, 1000), shapes (CNN, 600) and gpt (a
GPT trained as popular single-file scripts do: learning rate set by hand, clip 1.0, two param
groups, accumulation; 1000); each under AdamW and SGD with momentum 0.9, with a linear LR warm-up of
``min(20, steps // 10)`` steps and a cosine decay to 10%. The recipe's design was decided on
charlm-small and proselm; digits-mlp, shapes and gpt are held out.

Outputs in ``--out`` (:mod:`experiments.study_report`):

* ``runs/<workload>__<optimizer>__<method>__s<seed>.jsonl``: each run's log (rank 0), kept out of
  git (``.gitignore``); the study regenerates them;
* ``convergence.json``: one row per run: ``workload``, ``optimizer``, ``method``, ``seed``,
  ``steps``, ``buckets``, ``engine``, ``evals`` (``[step, time, held-out loss]`` every 2% of the
  run), ``final_loss``, ``final_accuracy`` (classifiers), ``bytes_total`` (bytes rank 0 handed to
  collectives over the run, dense start included), ``dense_bytes_total``, ``compression``,
  ``gap_to_dense`` (final loss / dense's - 1, same workload, optimizer, seed), ``accuracy_gap``;
* ``convergence.md``: the cells (median over seeds) and every run; ``*_loss_vs_step.png``.

Modes: the full study (every workload x optimizer x {dense, topk, twobit}, seeds ``--seeds``; a
run whose log is complete is skipped, so an interrupted study resumes); ``--quick`` (charlm-tiny, 12
steps: the smoke test); ``--only`` filters runs (``workload/optimizer/method``, ``*`` allowed);
``--aggregate`` only rebuilds the outputs.

Example::

    python -m experiments.convergence --out experiments/results/convergence --jobs 2
    python -m experiments.convergence --out /tmp/conv --quick
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

METHODS = ("dense", "fp16", "powersgd", "topk", "twobit", "auto", "topk-noef", "twobit-noef", "topk-plain",
           "twobit-plain")
OPTIMIZERS = ("adamw", "sgdm")
TOPK_DENSITY = 0.01
IN_PROGRESS_S = 120.0  # a log written to this recently belongs to a run still going elsewhere
#: Held-out evaluations per run: every 2% of the steps.
EVALS = 50
#: How the runs bucket their gradients (recorded in every row): DDP's default buckets.
BUCKETS = "default"


@dataclass(frozen=True)
class RunSpec:
    """One training run of the study."""

    workload: str  # "charlm-small", "charlm-tiny" or "digits"
    optimizer: str  # "adamw" or "sgdm"
    method: str
    seed: int
    steps: int
    eval_every: int
    eval_windows: int = 256

    @property
    def stem(self) -> str:
        return f"{self.workload}__{self.optimizer}__{self.method}__s{self.seed}"


# ---------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------
# The study.
# ---------------------------------------------------------------------------------------


def plan(quick: bool, seeds: List[int], methods=("dense", "topk", "twobit"), workloads=None, steps=None,
         optimizers=OPTIMIZERS) -> List[RunSpec]:
    """The study's runs: every workload x optimizer x method, seed by seed (so an interrupted study
    still has whole seeds); ``steps`` overrides the workloads' run lengths."""
    from experiments import suite

    if quick:
        return [RunSpec("charlm-tiny", o, m, s, 12, 6, 8) for s in seeds for o in OPTIMIZERS
                for m in ("dense", "topk", "twobit", "topk-plain")]
    return [RunSpec(w, o, m, seed, steps or suite.STEPS[w], max(1, (steps or suite.STEPS[w]) // EVALS))
            for seed in seeds for w in (workloads or suite.NAMES) for o in optimizers for m in methods]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (1-layer charlm, 12 steps)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--methods", default="dense,topk,twobit", help="comma-separated methods of the study")
    parser.add_argument("--workloads", help="comma-separated workloads (default: every one of experiments.suite)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, help="steps of every run (default: each workload's own)")
    parser.add_argument("--only", action="append", default=[], help="run only workload/optimizer/method (glob)")
    parser.add_argument("--jobs", type=int, default=2, help="simulated runs at once (one thread each)")
    parser.add_argument("--link", default="1gbit", help="link of the real-DDP runs (tc syntax) or 'unshaped'")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="fsdp: every run as real FSDP2 ranks (experiments.fsdp_train.run_study)")
    parser.add_argument("--aggregate", action="store_true", help="only rebuild the outputs from the logs")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a RunSpec as JSON: run it here
    parser.add_argument("--log", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _pending(specs: List[RunSpec], runs_dir: str) -> List[RunSpec]:
    """The runs whose log is neither complete nor being written by another study."""
    from experiments.study_report import is_complete

    pending = []
    for spec in specs:
        log_path = os.path.join(runs_dir, spec.stem + ".jsonl")
        if is_complete(log_path):
            continue
        if os.path.exists(log_path) and time.time() - os.path.getmtime(log_path) < IN_PROGRESS_S:
            print(f"{spec.stem}: being written by another run; skipped", flush=True)
            continue
        pending.append(spec)
    return pending


def run_simulated(specs: List[RunSpec], runs_dir: str, jobs: int, timeout_s: float) -> int:
    """Run ``specs`` in the simulation, ``jobs`` processes at once; the number that failed."""
    from experiments.study_report import is_complete

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    queue, running, failures = list(specs), [], 0
    while queue or running:
        while queue and len(running) < jobs:
            spec = queue.pop(0)
            log_path = os.path.abspath(os.path.join(runs_dir, spec.stem + ".jsonl"))
            output = open(os.path.join(runs_dir, spec.stem + ".out"), "w")
            process = subprocess.Popen([sys.executable, "-m", "experiments.simrun", json.dumps(asdict(spec)), log_path],
                                       stdout=output, stderr=subprocess.STDOUT, cwd=root, env=env)
            running.append((spec, process, output, log_path, time.monotonic()))
        time.sleep(0.5)
        for entry in list(running):
            spec, process, output, log_path, started = entry
            if process.poll() is None and time.monotonic() - started < timeout_s:
                continue
            if process.poll() is None:
                process.kill()
            process.wait()
            output.close()
            running.remove(entry)
            ok = is_complete(log_path)
            failures += not ok
            print(f"{spec.stem}: {'ok' if ok else 'FAILED'} (status {process.returncode}) in "
                  f"{time.monotonic() - started:.0f}s", flush=True)
    return failures


def run_ddp(specs: List[RunSpec], runs_dir: str, args) -> int:
    """Run ``specs`` as real DDP jobs on the shaped link, one after another; the number that failed."""
    from experiments import launch, netem
    from experiments.study_report import is_complete

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    failures = 0
    with netem.link(args.link) as link:
        for spec in specs:
            log_path = os.path.abspath(os.path.join(runs_dir, spec.stem + ".jsonl"))
            started = time.monotonic()
            command = [sys.executable, "-m", "experiments.convergence", "--out", args.out, "--worker",
                       json.dumps(asdict(spec)), "--log", log_path, "--nproc", str(args.nproc),
                       "--run-timeout", str(args.run_timeout)]  # fmt: skip
            env = link.env()
            env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
            with open(os.path.join(runs_dir, spec.stem + ".out"), "w") as output:
                status = launch.run_bounded(link.command(command), timeout=args.run_timeout + 60, env=env,
                                           stdout=output, stderr=subprocess.STDOUT, cwd=root)
            ok = is_complete(log_path)
            failures += not ok
            print(f"{spec.stem}: {'ok' if ok else 'FAILED'} (status {status}) in {time.monotonic() - started:.0f}s",
                  flush=True)
    return failures


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(RunSpec(**json.loads(args.worker)), args.log, args.nproc, args.run_timeout)
    from experiments.simrun import SIMULATED_METHODS
    from experiments.study_report import aggregate, markdown

    seeds = [int(s) for s in args.seeds.split(",")]
    specs = plan(args.quick, seeds, tuple(args.methods.split(",")),
                 args.workloads.split(",") if args.workloads else None, args.steps, tuple(args.optimizers.split(",")))
    if args.only:
        specs = [s for s in specs
                 if any(fnmatch.fnmatch(f"{s.workload}/{s.optimizer}/{s.method}", p) for p in args.only)]
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    failures = 0
    if not args.aggregate and args.parallel == "fsdp":  # real fully_shard ranks for every method
        from experiments.fsdp_train import run_study

        failures += run_study(specs, runs_dir, args)
    elif not args.aggregate:
        pending = _pending(specs, runs_dir)
        failures += run_simulated([s for s in pending if s.method in SIMULATED_METHODS], runs_dir, args.jobs,
                                  args.run_timeout)
        failures += run_ddp([s for s in pending if s.method not in SIMULATED_METHODS], runs_dir, args)
    rows = aggregate(args.out, specs, RunSpec, METHODS.index)
    print(markdown(rows), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
