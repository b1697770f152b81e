"""The comparison: gradient-communication methods x link rates x workloads.

Every run is ``experiments.train`` in a fresh set of processes (``--nproc`` ranks x
``--threads`` threads, default 2 x 1), inside a tbf-shaped network namespace for shaped
links (``experiments.netem``). Results go to ``--out`` (default ``results/``):

* ``runs/<workload>__<link>__<method>.jsonl`` (and ``.out``): each run's log and output;
* ``summary.json`` (a list of records, one per run), ``summary.csv``, ``meta.json``;
* ``results.md``: the table (also printed at the end), with the settings and caveats;
* plots (PNG): loss vs step, loss vs training time, step-time breakdown, bytes per step.

Record fields: ``workload``, ``method``, ``link`` (``1gbit``, ``unshaped``, ...),
``shaped``, ``link_fallback``, ``step_time_s`` (median over steps after the first
``WARMUP_SKIP``: DDP's bucket rebuild, the methods' dense warm-up and JIT compilation),
``step_time_over_floor`` (÷ the ``noop`` step time of the same workload and link),
``compute_s`` / ``compress_s`` / ``comm_s`` (the breakdown, see below),
``bytes_per_step`` / ``dense_bytes_per_step`` / ``compression_ratio`` (per rank),
``wire_bytes_per_step`` (measured on the namespace's loopback, shaped links only),
``final_loss`` (held-out loss at the end), ``final_train_loss``, ``accuracy`` (digits).

Breakdown: ``compute_s`` is the ``noop`` run's median step time (same workload and link:
forward, backward and optimizer with no communication); ``compress_s`` the median time
inside the compression hook on the training thread; ``comm_s = step - compute - compress``
(exposed communication, decompression and waiting for the other rank; clipped at 0).

Modes:

``--quick`` (default; under 10 minutes on 2 idle cores): time to dense's quality on charlm-small
    (the 0.4M-parameter transformer, AdamW) on four links, in three parts written under ``--out``:

    * ``convergence/``: 200 steps of dense, gradcomp's ``topk`` and ``twobit`` recipes (the
      in-process simulation of the 2 ranks, :mod:`experiments.simrun`) and torch's fp16 and PowerSGD
      hooks (real DDP): held-out loss every 2% of the run (:mod:`experiments.convergence`);
    * ``step_times/``: every method's step time on the unshaped loopback, 1 Gbit/s, 100 Mbit/s and
      10 Mbit/s from one launch of the ranks in interleaved rounds (:mod:`experiments.step_times`);
    * ``time_to_accuracy/``: steps to dense's final loss x 1.02 times the step time, over dense's
      time (:mod:`experiments.time_to_accuracy`); the table is printed at the end.
``--matrix`` (~12 minutes): the older matrix of separate runs per method and link
    * ``charlm``: the default 10.8M-parameter transformer, 15 steps, every baseline and
      gradcomp method on every link: the step-time comparison;
    * ``charlm-small``: the 0.4M-parameter preset, 200 steps, first link only, plus the
      no-error-feedback variants: the convergence comparison;
    * ``digits``: 200 steps, every method on every link (no-EF variants on the first).
``--full`` (~2-3 hours)
    ``charlm`` 300 steps with all methods (convergence at full size), ``charlm-small``
    1000 steps, ``digits`` 1000 steps.
``--tiny`` (for tests, ~1 minute)
    a 1-layer charlm and digits, 4 steps, noop/dense/topk, unshaped link.

Methods with ``-noef`` and the ``charlm-small`` workload run on the first link only:
they are about convergence, and losses do not depend on the link (runs are
deterministic given the seed).

Example::

    python -m experiments.compare --quick --out results/
    python -m experiments.compare --links unshaped,1gbit,100mbit --methods noop,dense,topk --workloads digits
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from experiments import launch, netem
from experiments.catalog import ALL_METHODS, METHODS, TIMING_METHODS
from experiments.compare_report import add_floor_fields, fmt, summarize_log, write_results

# The runs start the runner as a module of this package, from the directory that holds it,
# wherever --out points.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_MODULE = "experiments.train"
DEFAULT_LINKS = ("unshaped", "1gbit")
#: The methods of ``--parallel fsdp`` (``experiments.fsdp_train.METHODS``, not imported: it imports torch).
FSDP_METHODS = ("noop", "dense", "topk", "twobit")


@dataclass
class WorkloadPlan:
    """One workload of a comparison: which ``experiments.train`` arguments, how long, which methods."""

    name: str
    train_args: List[str]
    steps: int
    methods: Sequence[str]
    first_link_only: bool = False
    eval_every: int = 0
    seconds_per_step: float = 2.0  # generous bound, for the run's timeout


def plans_for(mode: str) -> Dict[str, WorkloadPlan]:
    """The workloads of ``mode`` (``tiny``, ``quick``, ``full``), by name."""
    if mode == "tiny":
        tiny_lm = ["--workload", "charlm", "--small", "--d-model", "32", "--layers", "1", "--heads", "2",
                   "--context", "16", "--eval-windows", "8"]  # fmt: skip
        return {
            "charlm-tiny": WorkloadPlan("charlm-tiny", tiny_lm, 4, ("noop", "dense", "topk"), eval_every=2),
            "digits": WorkloadPlan("digits", ["--workload", "digits"], 4, ("noop", "dense", "topk"), eval_every=2),
        }
    long = mode == "full"  # "matrix": the short runs
    return {
        "charlm": WorkloadPlan(
            "charlm", ["--workload", "charlm"], 300 if long else 15,
            ALL_METHODS if long else TIMING_METHODS, eval_every=30 if long else 0, seconds_per_step=15.0,
        ),
        "charlm-small": WorkloadPlan(
            "charlm-small", ["--workload", "charlm", "--small", "--eval-windows", "256"], 1000 if long else 200,
            ALL_METHODS, first_link_only=True, eval_every=100 if long else 20, seconds_per_step=2.0,
        ),
        "digits": WorkloadPlan(
            "digits", ["--workload", "digits"], 1000 if long else 200, ALL_METHODS,
            eval_every=100 if long else 20, seconds_per_step=1.0,
        ),
    }  # fmt: skip


@dataclass
class Run:
    plan: WorkloadPlan
    method: str
    rate: Optional[str]  # tc rate, or None for the unshaped loopback
    steps: int
    log: str = ""
    record: dict = field(default_factory=dict)

    @property
    def link_name(self) -> str:
        return self.rate or netem.UNSHAPED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.compare",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--link-mode", choices=netem.LINK_MODES, default="duplex",
                        help="duplex (default): a namespace per rank, each direction shaped at the rate; shared: "
                             "one shaped loopback whose rate all ranks' traffic shares")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="the default: time to accuracy on charlm-small, four links; < 10 minutes idle")
    mode.add_argument("--matrix", action="store_const", dest="mode", const="matrix", help="~12 minutes")
    mode.add_argument("--full", action="store_const", dest="mode", const="full", help="longer runs; hours")
    mode.add_argument("--tiny", action="store_const", dest="mode", const="tiny", help="a smoke test; ~1 minute")
    parser.add_argument("--out", default="results", help="output directory (default results/)")
    parser.add_argument(
        "--links", help=f"comma-separated tc rates or 'unshaped' (default {','.join(DEFAULT_LINKS)}; tiny: unshaped)"
    )
    parser.add_argument(
        "--methods", help=f"comma-separated subset of {','.join(ALL_METHODS)} (noop, the floor, is always run)"
    )
    parser.add_argument("--workloads", help="comma-separated subset of the mode's workloads")
    parser.add_argument("--steps", type=int, help="steps for every run (overrides the mode)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--density", type=float, default=0.01, help="top-k: the fraction of entries sent (default 0.01)"
    )
    parser.add_argument("--run-timeout", type=float, help="seconds per run (default: from steps and workload)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                        help="fsdp: every run under FSDP2's fully_shard (experiments.fsdp_train; methods "
                             "noop, dense, topk, twobit); records get \"parallel\": \"fsdp\"")
    parser.add_argument("--planned-steps", type=int, help="--parallel fsdp: the recipe plans for this many steps "
                        "(default: the run's); the steps after keep its final setting, so time that")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The comparison's arguments (:func:`_parser`), checked, with ``plans``, ``method_filter`` and
    ``rates`` resolved for the modes that run the matrix."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.mode = args.mode or "quick"
    if args.planned_steps is not None and args.parallel != "fsdp":
        parser.error("--planned-steps goes with --parallel fsdp")
    if args.parallel == "fsdp" and args.mode == "quick":
        parser.error("--parallel fsdp runs with --matrix, --full or --tiny (the quick mode's studies are DDP's; "
                     "python -m experiments.convergence --parallel fsdp gives held-out losses under FSDP)")
    if args.mode == "quick":
        return args
    plans = plans_for(args.mode)
    if args.workloads:
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        unknown = [w for w in names if w not in plans]
        if unknown:
            parser.error(f"unknown workloads {unknown} for --{args.mode}; choose from {sorted(plans)}")
        plans = {name: plans[name] for name in names}
    args.plans = plans
    if args.methods:
        args.method_filter = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in args.method_filter if m not in ALL_METHODS]
        if unknown:
            parser.error(f"unknown methods {unknown}; choose from {ALL_METHODS}")
    else:
        args.method_filter = None
    links = args.links.split(",") if args.links else (["unshaped"] if args.mode == "tiny" else list(DEFAULT_LINKS))
    try:
        args.rates = list(dict.fromkeys(netem.parse_rate(link) for link in links))
    except ValueError as error:
        parser.error(str(error))
    if args.steps is not None and args.steps < 2:
        parser.error("--steps must be >= 2")
    return args


def plan_runs(args) -> List[Run]:
    """All runs, ordered so that each (workload, link) starts with its ``noop`` floor."""
    runs = []
    for plan in args.plans.values():
        methods = [m for m in plan.methods if args.method_filter is None or m in args.method_filter]
        if args.parallel == "fsdp":  # what runs under FSDP (experiments.fsdp_train.METHODS)
            methods = [m for m in methods if m in FSDP_METHODS]
        if methods and "noop" not in methods:
            methods = ["noop", *methods]  # the floor that step_time_over_floor divides by
        for index, rate in enumerate(args.rates):
            for method in methods:
                if index > 0 and (plan.first_link_only or not METHODS[method].timing):
                    continue
                runs.append(Run(plan, method, rate, args.steps or plan.steps))
    return runs


def resolve_links(args) -> None:
    """When shaping is impossible here, say so once, loudly, and drop shaped links that
    would only repeat the unshaped runs (a lone shaped link runs unshaped, flagged)."""
    reason = netem.shaping_unavailable_reason()
    shaped = [rate for rate in args.rates if rate is not None]
    if reason is None or not shaped:
        return
    netem.warn_unshaped(",".join(shaped), reason)
    if None in args.rates:
        args.rates = [None]
    else:
        args.rates = [shaped[0]]  # netem.link falls back and flags the records


def _timeout_for(run: Run, args) -> float:
    if args.run_timeout:
        return args.run_timeout
    return 180.0 + run.steps * run.plan.seconds_per_step


def execute(run: Run, args, runs_dir: str) -> dict:
    """Run one ``experiments.train`` over its link; return its record (without floor-relative fields)."""
    fsdp = args.parallel == "fsdp"
    stem = f"{run.plan.name}__{run.link_name}__{run.method}" + ("__fsdp" if fsdp else "")
    run.log = os.path.join(runs_dir, stem + ".jsonl")
    timeout = _timeout_for(run, args)
    command = [
        sys.executable, "-m", "experiments.fsdp_train" if fsdp else TRAIN_MODULE, *run.plan.train_args,
        "--compressor", run.method, "--density", repr(args.density), "--steps", str(run.steps),
        "--seed", str(args.seed), "--nproc", str(args.nproc), "--threads", str(args.threads),
        "--eval-every", str(run.plan.eval_every if run.steps > run.plan.eval_every else 0),
        "--log", run.log, "--no-progress", "--max-time", str(timeout - 15), "--timeout", "300",
    ]  # fmt: skip
    if fsdp and args.planned_steps:
        command += ["--planned-steps", str(args.planned_steps)]
    if os.path.exists(run.log):
        os.remove(run.log)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.monotonic()
    output_path = os.path.join(runs_dir, stem + ".out")
    with netem.link(run.rate, args.link_mode, args.nproc) as link, open(output_path, "w") as output:
        env = link.env()
        env["PYTHONUNBUFFERED"] = "1"
        status = launch.run_bounded(
            link.command(command), timeout=timeout, env=env, cwd=PACKAGE_ROOT, stdout=output, stderr=subprocess.STDOUT
        )
        link_fields = link.record()
    wall = time.monotonic() - started
    record = summarize_log(run.log)
    record.update(link_fields)
    record.update(
        workload=run.plan.name,
        method=run.method,
        parallel=args.parallel,
        steps=run.steps,
        nproc=args.nproc,
        threads=args.threads,
        status="ok" if status == 0 else ("timeout" if status == 124 else f"failed ({status})"),
        wall_s=round(wall, 1),
        load_avg_1m=load,
        log=os.path.relpath(run.log, os.path.dirname(runs_dir)),
    )
    return record


#: The quick mode's convergence runs (charlm-small, AdamW) and links.
QUICK_STEPS = 200
QUICK_LINKS = ("unshaped", "1gbit", "100mbit", "10mbit")
#: Interleaved rounds and timed steps per round of the quick mode's step times: with 3 x 5 the
#: round medians spread 15-30 % on 1 Gbit/s and the unshaped loopback (2 cores, load 0.4).
QUICK_ROUNDS, QUICK_TIMED_STEPS = 5, 8


def quick(args) -> int:
    """The default mode: time to dense's quality on charlm-small (see the module docstring)."""
    out = os.path.abspath(args.out)
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    steps = [
        ["experiments.convergence", "--out", os.path.join(out, "convergence"), "--workloads", "charlm-small",
         "--optimizers", "adamw", "--steps", str(args.steps or QUICK_STEPS),
         "--methods", "dense,topk,twobit,fp16,powersgd", "--link", "unshaped"],
        ["experiments.step_times", "--workload", "charlm-small", "--optimizer", "adamw", "--links",
         args.links or ",".join(QUICK_LINKS), "--rounds", str(QUICK_ROUNDS), "--steps", str(QUICK_TIMED_STEPS),
         "--run-steps", str(args.steps or QUICK_STEPS), "--out", os.path.join(out, "step_times")],
        ["experiments.time_to_accuracy", "--convergence", os.path.join(out, "convergence"), "--step-times",
         os.path.join(out, "step_times"), "--out", os.path.join(out, "time_to_accuracy")],
    ]
    for argv in steps:
        print(f"compare: python -m {' '.join(argv)}", flush=True)
        status = subprocess.call([sys.executable, "-m", *argv], cwd=PACKAGE_ROOT, env=env)
        if status != 0:
            print(f"compare: {argv[0]} failed with status {status}", file=sys.stderr)
            return status
    return 0


def _meta(args, runs: List[Run]) -> dict:
    """The run's machine, versions, links and load, for ``meta.json``."""
    import torch  # only for the version in the metadata; runs import it themselves

    return {"mode": args.mode, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "nproc": args.nproc, "threads": args.threads,
            "links": [r or netem.UNSHAPED for r in args.rates], "runs": len(runs),
            "load_before": round(os.getloadavg()[0], 2), "command": " ".join(sys.argv)}


def _execute_and_report(index: int, run: Run, runs: List[Run], args, runs_dir: str) -> dict:
    """:func:`execute` one run, with a line of progress before and after."""
    print(f"[{index}/{len(runs)}] {run.plan.name:13s} {run.link_name:9s} {run.method:12s} {run.steps:5d} steps ...",
          end=" ", flush=True)
    record = execute(run, args, runs_dir)
    print(f"{record['status']} in {record['wall_s']:.0f}s: step {fmt(record.get('step_time_s'))} s, "
          f"held-out loss {fmt(record.get('final_loss'))}"
          + (" [link fallback: unshaped]" if record.get("link_fallback") else ""), flush=True)
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.mode == "quick":
        return quick(args)
    resolve_links(args)
    runs = plan_runs(args)
    if not runs:
        print("compare: nothing to run (check --methods/--workloads)", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out)
    runs_dir = os.path.join(out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    meta = _meta(args, runs)
    print(f"compare: {len(runs)} runs ({args.mode}) -> {out}", flush=True)
    started = time.monotonic()
    records = [_execute_and_report(index, run, runs, args, runs_dir) for index, run in enumerate(runs, 1)]
    add_floor_fields(records)
    meta["wall_s"] = time.monotonic() - started
    meta["load_after"] = round(os.getloadavg()[0], 2)
    table = write_results(out, records, meta)
    if not args.no_plots:
        from experiments import plots  # matplotlib only when plots are asked for

        for path in plots.make_plots(records, out):
            print(f"plot: {os.path.relpath(path)}")
    print()
    print(table)
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        print(f"\ncompare: {len(failed)} run(s) did not finish; see {runs_dir}/*.out", file=sys.stderr)
    fallback = [r for r in records if r.get("link_fallback")]
    if fallback:
        netem.warn_unshaped(
            ",".join(sorted({r["link_requested"] for r in fallback})), fallback[0]["link_fallback_reason"]
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
