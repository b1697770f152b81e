"""Step times of every method on every link, from one launch of the ranks, in interleaved rounds.

One launch of 2 ranks (DDP over Gloo, one thread each, a full-duplex emulated link: one network
namespace per rank, ``netem.link(mode="duplex")``) holds one DDP replica per method, all from the
same weights: ``noop`` (no communication: the compute floor), ``dense``, torch's ``fp16`` and
``powersgd`` hooks, and gradcomp's ``topk``/``twobit`` recipes and ``auto`` at their final setting
(each replica is first trained through its dense start and ramp, ``auto`` also through its trials), and
``start``: a step of the recipes' dense start after DDP's first two, the fp16 cast (the top-k recipe of a
run planned :data:`START_PLANNED_STEPS` long, timed inside its dense start).
Then, for ``--rounds`` rounds, for each link of ``--links`` (the link changes between them by
``tc qdisc replace`` on both ends of both ranks' links, no process restarts): ``--settle`` untimed steps
of each method, then timed steps of every method in turn (one step of each, the order rotated every
step): at least ``--steps``, and on a link whose step is short as many as fill ``--round-seconds``
(counted from the first round's settle steps, the same on every rank and in every round): 6 steps of
a 4 ms step spread the round medians of the study's MLP 13-64 %.
Every timed step starts from a barrier (outside the clock): without it a step inherited the ranks' skew at
the end of the step before it, another method's (up to 350 ms at 10 Mbit/s), and Gloo's allgather makes a late
rank's receive later still (``gradcomp.hooks.direct``): the 2-bit recipe's step at 10 Mbit/s read 256-327 ms
without the barrier and 216-224 ms with it, top-k's 86-100 and 82-86 ms (charlm-small, AdamW; informal).
A method's time on a link is the median over rounds of the per-round median step time (the slower
rank's, step by step); its ``spread`` is the range of those round medians over their median. The
machine's own speed drifts between rounds (on 2 shared cores the compute floor alone spread 20-33 %),
so each method is also compared with dense step by step: step ``i`` of both, taken in turn, make a
pair, and ``ratio_vs_dense`` is the median over rounds of each round's median paired ratio, with
its ``ratio_spread``. The load average before the run (``$QUIET_LOAD_BEFORE``, set by
``../shared/tools/quiet``) is recorded.

Output (``--out``): ``step_times.json``, a list of rows ``{workload, optimizer, method, link,
step_time, spread, rounds: [...], load_before, dense_step_over_compute (dense rows), ratio_vs_dense,
ratio_spread, ratio_rounds (rows of other methods on a link dense was timed on)}`` and a table.
Run it alone on the machine::

    ../shared/tools/quiet python -m experiments.step_times --workload charlm-small --out DIR
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from typing import Dict, List

__all__ = ["main", "summarize", "spread"]

METHODS = ("noop", "dense", "fp16", "powersgd", "topk", "twobit", "auto", "start")
LINKS = ("unshaped", "10gbit", "1gbit", "100mbit", "10mbit")
#: Methods whose replica is set up on each link it is timed on (a policy measures its link).
PER_LINK = ("auto",)
#: The most timed steps of a method in one round on one link (bounds a round whatever the estimate).
MAX_ROUND_STEPS = 400
#: Steps the recipes run before timing: through their dense start and ramp, to the final setting.
PLANNED_STEPS = 40
#: The run ``start`` plans for: its dense start (5 % of it at least, no scheduler) outlasts any benchmark.
START_PLANNED_STEPS = 10**6
#: The most untimed steps after those while a policy still runs trials (each of its three candidates
#: may take one: 3 x 8 cycles of 3 steps, and a step between them).
MAX_DECIDING_STEPS = 80


def _set_link(rate: str) -> None:
    """Every end of the duplex link to ``rate`` (``unshaped``: no qdisc), from rank 0's process."""
    from experiments import netem, netem_tbf

    names = os.environ["GRADCOMP_NETNS_RANKS"].split(",")
    hub = names[0].rsplit("-r", 1)[0] + "-hub"
    netem_tbf.set_rate(names, hub, netem.DUPLEX_IFNAME, None if rate == "unshaped" else rate)


def _agree_on_link(rate: str, rank: int) -> None:
    """Rank 0 sets the link; every rank waits for it."""
    import torch.distributed as dist

    if rank == 0:
        _set_link(rate)
    dist.barrier()


def _replica(method: str, net, loop, run_steps: int):
    """``(ddp model, optimizer, scheduler, gradcomp state or None)`` of ``method`` on a copy of ``net``."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from experiments import loop as loops
    from experiments import methods

    model = copy.deepcopy(net)
    ddp = DistributedDataParallel(model)
    optimizer, scheduler = loops.build_optimizer(loop, model)
    # gradcomp's recipes at their final setting after PLANNED_STEPS, with the 2-bit code of a run_steps
    # run (3-bit's payload costs 1.38x the ternary code's); the others as they are.
    attached, planned = (("topk", START_PLANNED_STEPS) if method == "start" else (method, PLANNED_STEPS))
    telemetry = methods.attach_study_method(ddp, attached, optimizer, None if method == "start" else scheduler,
                                            planned, dense_bytes=sum(p.numel() * 4 for p in model.parameters()),
                                            code_steps=run_steps)
    torch.manual_seed(0)
    return ddp, optimizer, scheduler, telemetry.state


def _policy_summary(replica) -> dict:
    """What a replica's policy chose (``{}`` without one): the link it fitted and, per choice, how
    many groups took it and their elements, its last trial and the candidates trials rejected."""
    policy = replica[3].stats().get("policy") if replica[3] is not None else None
    if not policy:
        return {}
    chosen: Dict[str, List[int]] = {}
    for decision in policy["groups"].values():
        groups, numel = chosen.get(decision["choice"], [0, 0])
        chosen[decision["choice"]] = [groups + 1, numel + decision["numel"]]
    return {"link": policy["link"], "groups_and_elements": chosen, "trial": policy["trial"],
            "rejected": policy["rejected"]}


def _step(replica, workload, loop, rank: int, step: int) -> float:
    """One timed optimizer step of a replica; seconds (its batch drawn and the ranks met before the clock
    starts). The barrier keeps a step from inheriting the ranks' skew at the end of the step before it, another
    method's: a rank that starts its exchange late waits less, and the other waits for it inside its step."""
    import torch.distributed as dist

    from experiments import loop as loops

    ddp, optimizer, scheduler, _ = replica
    batches = loops.micro_batches(workload, loop, rank, step, workload.default_batch_size)
    dist.barrier()
    return loops.timed_optimizer_step(ddp, workload, loop, optimizer, scheduler, batches, step)[1]


def _interleaved(timed, keys: Dict[str, tuple], count: int) -> Dict[str, List[float]]:
    """``count`` timed steps of every method of ``keys`` (method -> replica key), one step of each in
    turn, the order rotated every step: whatever slows the machine for a while slows every method
    alike, so step ``i`` of two methods makes a pair. ``timed(key)`` takes one step of a replica and
    returns its seconds. Returns each method's seconds, in step order."""
    methods = list(keys)
    seconds: Dict[str, List[float]] = {m: [] for m in methods}
    for i in range(count):
        for j in range(len(methods)):
            key = keys[methods[(i + j) % len(methods)]]
            seconds[key[0]].append(timed(key))
    return seconds


def timed_rounds(keys_on, timed, set_link, agreed, args, after_round=None) -> Dict[tuple, List[List[float]]]:
    """``args.rounds`` rounds over ``args.links``: on each link (``set_link(rate)``, every rank), ``args.settle``
    untimed steps of each method of ``keys_on(rate)`` (method -> replica key), then :func:`_interleaved` steps,
    as many per method as :func:`round_steps` gives in the first round (``agreed(count)``: the ranks' largest),
    then ``after_round(rate, keys)``. ``timed(key)``: one step of a replica, its seconds. Returns
    ``{(method, rate): [round 0's seconds, ...]}``."""
    times: Dict[tuple, List[List[float]]] = {}
    per_round: Dict[str, int] = {}  # timed steps per method on each link, fixed by the first round
    for _ in range(args.rounds):
        for rate in args.links.split(","):
            set_link(rate)
            here = keys_on(rate)
            cycle = sum(timed(key) for key in here.values() for _ in range(args.settle)) / max(args.settle, 1)
            if rate not in per_round:
                per_round[rate] = agreed(round_steps(cycle, args.round_seconds, args.steps))
            for method, seconds in _interleaved(timed, here, per_round[rate]).items():
                times.setdefault((method, rate), []).append(seconds)
            if after_round is not None:
                after_round(rate, here)
    return times


def round_steps(cycle_seconds: float, round_seconds: float, minimum: int) -> int:
    """Timed steps per method in a round: enough cycles (one step of every method, ``cycle_seconds``)
    to fill ``round_seconds``, at least ``minimum``, at most :data:`MAX_ROUND_STEPS`."""
    wanted = math.ceil(round_seconds / cycle_seconds) if cycle_seconds > 0 else MAX_ROUND_STEPS
    return max(minimum, min(wanted, MAX_ROUND_STEPS))


def _agreed(count: int) -> int:
    """The largest of every rank's ``count`` (the ranks step together, so they must agree)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def bench_rank(rank: int, world_size: int, args) -> None:
    """Rank ``rank`` of the benchmark (the process group from ``MASTER_ADDR``/``MASTER_PORT``); rank 0
    writes ``rounds.json`` (every rank's step times, per round) and ``policy_choices.json`` under ``args.out``.

    Not a training run (:mod:`experiments.runner`): one replica per method, stepped in interleaved
    rounds with the link changed between them; it shares the runner's timed step
    (:func:`experiments.loop.timed_optimizer_step`), the methods' attachment
    (:func:`experiments.methods.attach_study_method`) and the rank's set-up
    (:func:`experiments.launch.init_rank`)."""
    import warnings

    import torch.distributed as dist

    from experiments import launch, suite
    from experiments import loop as loops

    warnings.filterwarnings("ignore")
    launch.init_rank(rank, world_size, threads=1, timeout=1800, cuda=False)
    workload = suite.build(args.workload, 0, 32)
    loop = loops.loop_for(args.workload, args.optimizer, PLANNED_STEPS)
    net = workload.build_model()
    methods, links = args.methods.split(","), args.links.split(",")
    # A policy measures the link it runs on: `auto` has one replica per link, set up on that link.
    keys = [(m, rate) for m in methods for rate in (links if m in PER_LINK else [None])]
    run_steps = args.run_steps or suite.STEPS[args.workload]
    replicas = {key: _replica(key[0], net, loop, run_steps) for key in keys}
    counter = {key: 0 for key in keys}

    def timed(key) -> float:
        """One step of a replica; its seconds."""
        counter[key] += 1
        return _step(replicas[key], workload, loop, rank, counter[key] - 1)

    for rate in [None] + links:
        _agree_on_link("unshaped" if rate is None else rate, rank)
        for key in (k for k in keys if k[1] == rate):
            _to_final_setting(replicas[key], lambda count: sum(timed(key) for _ in range(count)), key[0])
    chosen: Dict[str, List[dict]] = {}

    def choices(rate: str, here: Dict[str, tuple]) -> None:
        for method, key in here.items():
            if replicas[key][3] is not None and replicas[key][3].engine.policy is not None:
                chosen.setdefault(f"{method}|{rate}", []).append(_policy_summary(replicas[key]))

    times = timed_rounds(lambda rate: {m: (m, rate if m in PER_LINK else None) for m in methods}, timed,
                         lambda rate: _agree_on_link(rate, rank), _agreed, args, choices)
    _write_rounds(times, chosen, rank, args.out)
    dist.barrier()
    dist.destroy_process_group()


def _to_final_setting(replica, steps, method: str) -> None:
    """Untimed steps (``steps(count)``) through a recipe's dense start and ramp, and a policy's trials; ``start``
    must still be inside its fp16 dense start."""
    steps(PLANNED_STEPS)
    if method == "start" and type(replica[3].engine.compressor_now()).__name__ != "FP16":
        raise RuntimeError(f"start: the replica left its fp16 dense start (step {replica[3].engine.step})")
    policy = replica[3].engine.policy if replica[3] is not None else None
    for _ in range(MAX_DECIDING_STEPS):
        if policy is None or not policy.deciding:  # the same on every rank: its verdicts are shared
            return
        steps(1)


def _write_rounds(times: Dict[tuple, List[List[float]]], chosen: Dict[str, List[dict]], rank: int, out: str) -> None:
    """Every rank's step times (``(method, link)`` -> per round, per step) gathered; rank 0 writes them
    to ``out/rounds.json`` and its policy choices to ``out/policy_choices.json``."""
    from gradcomp import inflight

    gathered = inflight.all_gather_object({f"{m}|{r}": v for (m, r), v in times.items()})
    if rank == 0:
        with open(os.path.join(out, "rounds.json"), "w") as f:
            json.dump(gathered, f)
        with open(os.path.join(out, "policy_choices.json"), "w") as f:
            json.dump(chosen, f, indent=1)  # rank 0's; every rank computes the same choices


def spread(values: List[float]) -> float:
    """The range of ``values`` (round medians, or per-round ratios) over their median."""
    return (max(values) - min(values)) / statistics.median(values)


def summarize(gathered: List[dict], args, load_before) -> List[dict]:
    """Rows: per method and link, the median over rounds of the round medians of the slower rank's step
    times, and against dense on the same link the median over rounds of the per-round median of the
    paired ratios (step ``i`` of the method over step ``i`` of dense, taken in turn)."""
    slower = {key: [[max(rank[key][r][i] for rank in gathered) for i in range(len(per_round))]
                    for r, per_round in enumerate(gathered[0][key])] for key in gathered[0]}
    rows = []
    for key, per_round in slower.items():
        method, link = key.split("|")
        rounds = [statistics.median(steps) for steps in per_round]
        median = statistics.median(rounds)
        row = {"workload": args.workload, "optimizer": args.optimizer, "method": method, "link": link,
               "step_time": median, "spread": spread(rounds), "rounds": rounds,
               "steps_per_round": len(per_round[0]), "load_before": load_before}
        dense = slower.get(f"dense|{link}")
        if dense is not None and method != "dense":
            ratios = [statistics.median(a / b for a, b in zip(mine, theirs)) for mine, theirs in zip(per_round, dense)]
            ratio = statistics.median(ratios)
            row.update(ratio_vs_dense=ratio, ratio_spread=spread(ratios), ratio_rounds=ratios)
        rows.append(row)
    floor = {r["link"]: r["step_time"] for r in rows if r["method"] == "noop"}
    for row in rows:
        if row["method"] == "dense" and row["link"] in floor:
            row["dense_step_over_compute"] = row["step_time"] / floor[row["link"]]
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="charlm-small")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method, link and round")
    parser.add_argument("--round-seconds", type=float, default=0.0, help="a round's timed steps on one link take "
                        "about this long, all methods together (steps per method: at least --steps)")
    parser.add_argument("--settle", type=int, default=2, help="untimed steps after each link change")
    parser.add_argument("--run-steps", type=int, help="the run whose recipe is timed: its length decides the 2-bit "
                        "code (default: the convergence study's length of the workload)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=3600.0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.rank is not None:
        bench_rank(args.rank, 2, args)
        return 0
    from experiments import launch, netem

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with netem.link("10gbit", mode="duplex", ranks=2) as link:
        if not link.shaped:
            print("step_times: no emulated link (needs root); nothing measured", file=sys.stderr)
            return 1
        env = link.env()
        env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        argv = [sys.executable, "-m", "experiments.step_times", *(argv if argv is not None else sys.argv[1:])]
        codes, _ = launch.run_commands([link.rank_command(r, argv + ["--rank", str(r)]) for r in range(2)],
                                       timeout=args.timeout, env=env, cwd=root)
    if codes != [0, 0]:
        print(f"step_times: ranks exited with {codes}", file=sys.stderr)
        return 1
    with open(os.path.join(args.out, "rounds.json")) as f:
        rows = summarize(json.load(f), args, os.environ.get("QUIET_LOAD_BEFORE"))
    with open(os.path.join(args.out, f"step_times_{args.workload}_{args.optimizer}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for row in sorted(rows, key=lambda r: (LINKS.index(r["link"]) if r["link"] in LINKS else 9, r["method"])):
        paired = (f"  {row['ratio_vs_dense']:.3f}x dense (paired, spread {row['ratio_spread']:.1%})"
                  if "ratio_vs_dense" in row else "")
        print(f"{row['link']:>9} {row['method']:>9} {row['step_time'] * 1000:9.1f} ms  spread {row['spread']:.1%}"
              + paired)
    return 0


if __name__ == "__main__":
    sys.exit(main())
