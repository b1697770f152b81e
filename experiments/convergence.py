"""The convergence study: does compressed training reach the dense held-out loss, on models of
different kinds, with the workloads' own training loops?

Runs of gradcomp's methods and of dense DDP go through the in-process simulation of the ranks
(:mod:`experiments.simrun`: the engine's own compress, exchange, average and stage on 2 ranks,
bitwise the real DDP run over Gloo, ``tests/test_grad_contract.py``), so that the study takes hours,
not days, on two cores: ``--jobs`` runs at once, one thread each. torch's hooks (``fp16``,
``powersgd``) and ``auto`` (which measures a link) run real DDP over Gloo, 2 ranks x 1 thread, on the
shaped link ``--link`` (``netem.py``; the ranks are :mod:`experiments.convergence_ddp`). Every run uses
DDP's default buckets (``"buckets"`` in its row).

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

Runs of one code and seed part between machines (vector units round differently), by up to a per cent on the
language models: ``--dense-here`` also runs dense on this machine beside each compressed run whose dense run it
did not make (:func:`dense_here`), so that a gap is read on one machine.

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
  ``gap_to_dense`` (final loss / dense's - 1, same workload, optimizer, seed), ``accuracy_gap``,
  ``code`` and ``machine`` (:mod:`experiments.fingerprint`: which code and which machine made the run) and
  ``same_machine_as_dense`` (a gap across machines is said so in ``convergence.md``: runs part between them);
* ``convergence.md``: the cells (median over seeds) and every run; ``*_loss_vs_step.png``.

Modes: the full study (every workload x optimizer x {dense, topk, twobit}, seeds ``--seeds``; a
run whose log is complete and was made by the current code, :mod:`experiments.fingerprint`, is skipped,
so an interrupted study resumes and a changed recipe runs again); ``--quick`` (charlm-tiny, 12
steps: the smoke test); ``--only`` filters runs (``workload/optimizer/method``, ``*`` allowed);
``--aggregate`` only rebuilds the outputs.

Example::

    python -m experiments.convergence --out experiments/results/convergence --jobs 2
    python -m experiments.convergence --out /tmp/conv --quick
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import List

from experiments.convergence_ddp import run_worker

METHODS = ("dense", "fp16", "powersgd", "topk", "twobit", "auto", "topk-noef", "twobit-noef", "topk-plain",
           "twobit-plain", "threebit")
OPTIMIZERS = ("adamw", "sgdm")
IN_PROGRESS_S = 120.0  # a log written to this recently belongs to a run still going elsewhere
#: Held-out evaluations per run: every 2% of the steps.
EVALS = 50


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
    parser.add_argument("--parallel", choices=("ddp", "fsdp", "horovod"), default="ddp",
                        help="fsdp: every run as real FSDP2 ranks (experiments.fsdp_train.run_study); horovod: "
                        "under horovodrun with Horovod's and gradcomp's distributed optimizers "
                        "(experiments.horovod_train.run_study)")
    parser.add_argument("--aggregate", action="store_true", help="only rebuild the outputs from the logs")
    parser.add_argument("--dense-here", action="store_true", help="also run dense on this machine beside each "
                        "compressed run whose dense run this machine did not make (runs part between machines)")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a RunSpec as JSON: run it here
    parser.add_argument("--log", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _pending(specs: List[RunSpec], runs_dir: str) -> List[RunSpec]:
    """The runs whose log is not complete from the current code (:func:`experiments.study_report.is_current`)
    nor being written by another study."""
    from experiments.study_report import is_complete, is_current

    pending = []
    for spec in specs:
        log_path = os.path.join(runs_dir, spec.stem + ".jsonl")
        if is_current(log_path):
            continue
        if is_complete(log_path):
            print(f"{spec.stem}: its log was made by other code; run again", flush=True)
        elif os.path.exists(log_path) and time.time() - os.path.getmtime(log_path) < IN_PROGRESS_S:
            print(f"{spec.stem}: being written by another run; skipped", flush=True)
            continue
        pending.append(spec)
    return pending


def dense_here(pending: List[RunSpec], runs_dir: str, out: str) -> List[RunSpec]:
    """The dense runs to make on this machine beside ``pending`` (``--dense-here``): for each compressed run, the dense
    run of its workload, optimizer, seed and length, unless a log in ``runs_dir`` from the current code or a row of
    ``out/convergence.json`` says this machine (:func:`experiments.fingerprint.machine`) made it. Runs of one code
    and seed part between machines by up to a per cent on the language models, as much as the study's margins
    (``experiments/results/research-shapes-sgd-seeds/``), so a gap is read against dense of the same machine."""
    from experiments import fingerprint
    from experiments.study_report import is_current, read_log

    here, path = fingerprint.machine(), os.path.join(out, "convergence.json")
    rows = []
    if os.path.exists(path):
        with open(path) as handle:
            rows = json.load(handle)
    extra: List[RunSpec] = []
    for spec in pending:
        dense = replace(spec, method="dense")
        if spec.method == "dense" or dense in pending or dense in extra:
            continue
        log = os.path.join(runs_dir, dense.stem + ".jsonl")
        config = next((r for r in read_log(log) if r.get("event") == "config"), {})
        if is_current(log) and config.get("machine") == here:
            continue
        fields = asdict(dense)
        if any(row.get("machine") == here and all(row.get(k) == v for k, v in fields.items()) for row in rows):
            continue
        print(f"{dense.stem}: run here beside {spec.stem} (this machine made no dense run of it)", flush=True)
        extra.append(dense)
    return extra


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


def run_launched(specs: List[RunSpec], runs_dir: str, kind: str, methods, command_of, timeout_s: float) -> int:
    """Run ``specs`` one after another, each as the command ``command_of(spec, log_path)`` (its ranks
    launched by that command, unshaped), bounded by ``timeout_s``; logs ``<stem>__<kind>.jsonl``. A spec
    whose method is not in ``methods`` is skipped, one whose log is current is kept. Returns the number
    that failed."""
    from experiments import launch
    from experiments.study_report import is_complete, is_current

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    failures = 0
    for spec in specs:
        if spec.method not in methods:
            print(f"{spec.stem}: {spec.method} does not run under {kind}; skipped", flush=True)
            continue
        log_path = os.path.abspath(os.path.join(runs_dir, f"{spec.stem}__{kind}.jsonl"))
        if is_current(log_path):
            continue
        started = time.monotonic()
        with open(log_path[: -len(".jsonl")] + ".out", "w") as output:
            status = launch.run_bounded(command_of(spec, log_path), timeout=timeout_s, env=env, cwd=root,
                                        stdout=output, stderr=subprocess.STDOUT)
        ok = is_complete(log_path)
        failures += not ok
        print(f"{spec.stem} ({kind}): {'ok' if ok else 'FAILED'} (status {status}) in "
              f"{time.monotonic() - started:.0f}s", flush=True)
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
    elif not args.aggregate and args.parallel == "horovod":
        from experiments.horovod_train import run_study as run_horovod_study

        failures += run_horovod_study(specs, runs_dir, args)
    elif not args.aggregate:
        pending = _pending(specs, runs_dir)
        if args.dense_here:
            pending += dense_here(pending, runs_dir, args.out)
        failures += run_simulated([s for s in pending if s.method in SIMULATED_METHODS], runs_dir, args.jobs,
                                  args.run_timeout)
        failures += run_ddp([s for s in pending if s.method not in SIMULATED_METHODS], runs_dir, args)
    rows = aggregate(args.out, specs, RunSpec, METHODS.index)
    print(markdown(rows), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
