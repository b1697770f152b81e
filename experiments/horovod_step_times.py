"""Step times of the convergence study's methods under Horovod, on each emulated link, in interleaved rounds.

The Horovod twin of :mod:`experiments.step_times`, for the time to dense's quality on the Horovod path
(:mod:`experiments.time_to_accuracy` reads both). horovodrun's rendezvous must reach every rank, so
the link is the shared medium (``netem.link(rate)``: one namespace whose loopback is shaped at the
rate, horovodrun and its ranks inside it; both directions share the rate, so a dense step here
moves its bytes at about half the duplex link's speed of :mod:`experiments.step_times`). For
``--rounds`` rounds, for each link of ``--links``: each method in turn (the order rotated every
round) as one horovodrun launch of ``experiments.horovod_train --study-spec`` for ``--steps``
steps, with the recipe planned for ``--planned-steps`` steps, so that the steps after those (and
``--settle`` more) run at the recipe's final setting. A launch's time is rank 0's median over those
steps; a method's time on a link is the median over rounds, ``spread`` the range of the rounds
over that median, and ``ratio_vs_dense`` the median over rounds of the round's time over dense's
launch of the same round and link (``ratio_spread`` likewise). ``load_before`` is
``$QUIET_LOAD_BEFORE``, which ``../shared/tools/quiet`` sets.

Output (``--out``): ``step_times_<workload>_<optimizer>.json``, rows as :mod:`experiments.step_times`
writes them plus ``"integration": "horovod"`` and ``"link_mode": "shared"``, and
``horovod_rounds.json`` (every launch's step times). ``start``, as on DDP (:mod:`experiments.step_times`), is a step
of the recipes' dense start after its exact ones, the fp16 cast: the top-k recipe of a run planned
:data:`~experiments.step_times.START_PLANNED_STEPS` long, timed from step
:data:`~gradcomp.schedule.EXACT_DENSE_STEPS` ``+ --settle`` on, each timed step checked to have sent half of
dense's bytes and no more than dense's (groups under ``min_numel`` go whole)::

    ../shared/tools/quiet python -m experiments.horovod_step_times --workload charlm-small --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import Dict, List

__all__ = ["main", "launch_times", "summarize"]

METHODS = ("dense", "topk", "twobit", "start")
LINKS = ("unshaped", "1gbit", "100mbit", "10mbit")


def launch_times(workload: str, optimizer: str, method: str, link, args) -> List[float]:
    """Rank 0's step times at the final setting of one horovodrun launch of ``method`` on ``link``
    (a :class:`experiments.netem.Link`); raises ``RuntimeError`` when the launch fails."""
    from experiments import launch
    from experiments.horovod_train import horovodrun_command
    from experiments.step_times import START_PLANNED_STEPS
    from experiments.study_report import read_log
    from gradcomp.schedule import EXACT_DENSE_STEPS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = method == "start"  # the top-k recipe inside its dense start: its fp16 casts
    spec = {"workload": workload, "optimizer": optimizer, "method": "topk" if start else method, "seed": 0,
            "steps": args.steps, "eval_every": 0, "eval_windows": 32}
    planned = START_PLANNED_STEPS if start else args.planned_steps
    with tempfile.TemporaryDirectory() as scratch:
        log_path = os.path.join(scratch, "log.jsonl")
        command = horovodrun_command(["--study-spec", json.dumps(spec), "--planned-steps", str(planned),
                                      "--code-steps", str(args.run_steps), "--log", log_path])
        env = link.env()
        env.update(PYTHONPATH=root + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        with open(os.path.join(scratch, "out"), "w") as output:
            status = launch.run_bounded(link.command(command), timeout=args.launch_timeout, env=env, cwd=root,
                                        stdout=output, stderr=output)
        records = read_log(log_path)
        if status != 0 or not any(r.get("event") == "done" for r in records):
            with open(os.path.join(scratch, "out")) as output:
                tail = output.read()[-3000:]
            raise RuntimeError(f"{method} on {link.label}: horovodrun exited with {status}\n{tail}")
    first = (EXACT_DENSE_STEPS if start else args.planned_steps) + args.settle
    timed = [r for r in records if r.get("event") == "step" and r["step"] >= first]
    # a cast sends half of dense's bytes, groups under min_numel whole: less than dense's, not less than half
    if start and not all(r["dense_bytes"] <= 2 * r["bytes_sent"] < 2 * r["dense_bytes"] for r in timed):
        raise RuntimeError(f"start on {link.label}: a timed step was not the dense start's fp16 cast")
    return [r["step_time_s"] for r in timed]


def run(args) -> Dict[str, List[List[float]]]:
    """Every launch's step times, ``{"method|link": [round 0's, round 1's, ...]}``."""
    from experiments import netem

    methods, links = args.methods.split(","), args.links.split(",")
    times: Dict[str, List[List[float]]] = {}
    for round_index in range(args.rounds):
        for rate in links:
            with netem.link(rate) as link:
                order = methods[round_index % len(methods):] + methods[:round_index % len(methods)]
                for method in order:
                    seconds = launch_times(args.workload, args.optimizer, method, link, args)
                    times.setdefault(f"{method}|{link.label}", []).append(seconds)
                    milliseconds = 1000 * statistics.median(seconds)
                    print(f"round {round_index} {link.label:>9} {method:>7} {milliseconds:8.1f} ms", flush=True)
    return times


def summarize(times: Dict[str, List[List[float]]], args, load_before) -> List[dict]:
    """Rows: per method and link, the median over rounds of each launch's median step time, its spread,
    and the median over rounds of the round's ratio to dense's launch on the same link."""
    medians = {key: [statistics.median(steps) for steps in per_round] for key, per_round in times.items()}
    rows = []
    for key, rounds in medians.items():
        method, link = key.split("|")
        median = statistics.median(rounds)
        row = {"workload": args.workload, "optimizer": args.optimizer, "method": method, "link": link,
               "step_time": median, "spread": (max(rounds) - min(rounds)) / median, "rounds": rounds,
               "steps_per_round": len(times[key][0]), "load_before": load_before,
               "integration": "horovod", "link_mode": "shared"}
        dense = medians.get(f"dense|{link}")
        if dense is not None and method != "dense":
            ratios = [mine / theirs for mine, theirs in zip(rounds, dense)]
            ratio = statistics.median(ratios)
            row.update(ratio_vs_dense=ratio, ratio_spread=(max(ratios) - min(ratios)) / ratio, ratio_rounds=ratios)
        rows.append(row)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.horovod_step_times",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="charlm-small")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24, help="steps per launch, the planned ones included")
    parser.add_argument("--planned-steps", type=int, default=8, help="the recipe's total_steps in a launch")
    parser.add_argument("--settle", type=int, default=2, help="untimed steps after the planned ones")
    parser.add_argument("--launch-timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--run-steps", type=int, default=200, help="the run whose recipe is timed: its length "
                        "decides the 2-bit code (the Horovod convergence run's 200 steps)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.steps <= args.planned_steps + args.settle:
        parser.error("--steps must exceed --planned-steps + --settle (the timed steps come after them)")
    if "dense" not in args.methods.split(","):
        parser.error("--methods must include dense (every ratio is to it)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    load = os.environ.get("QUIET_LOAD_BEFORE")
    times = run(args)
    with open(os.path.join(args.out, "horovod_rounds.json"), "w") as f:
        json.dump(times, f)
    rows = summarize(times, args, float(load) if load else None)
    path = os.path.join(args.out, f"step_times_{args.workload}_{args.optimizer}.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    for row in rows:
        paired = (f"  {row['ratio_vs_dense']:.3f}x dense (spread {row['ratio_spread']:.1%})"
                  if "ratio_vs_dense" in row else "")
        print(f"{row['link']:>9} {row['method']:>7} {1000 * row['step_time']:8.1f} ms  "
              f"spread {row['spread']:.1%}{paired}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
