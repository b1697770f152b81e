"""Step times of the convergence study's methods under Horovod, from one launch of the ranks, in interleaved rounds.

The Horovod twin of :mod:`experiments.step_times`, for the time to dense's quality on the Horovod path
(:mod:`experiments.time_to_accuracy` reads both), with its rounds (:func:`experiments.step_times.timed_rounds`)
and its summary. One ``horovodrun`` launch of 2 ranks holds one model per method, all from the same weights,
each with its own optimizer and distributed optimizer (:func:`experiments.horovod_train.study_optimizer`, its
parameters named after the method, so that the models' exchanges never share a name): ``noop`` (no
communication: the compute floor), ``dense`` (Horovod's allreduce), ``fp16`` (Horovod's optimizer with
gradcomp's fp16 compressor), gradcomp's ``topk``/``twobit`` recipes at their final setting, and ``start``
(a step of the top-k recipe's dense start, its fp16 cast, as on DDP). Every timed step starts from
``hvd.barrier()`` (outside the clock). horovodrun's rendezvous must reach every rank, so the link is the
shared medium (``netem.link(rate)``: one namespace whose loopback is shaped, horovodrun and its ranks inside
it; both directions share the rate, so a dense step here moves its bytes at about half the duplex link's
speed of :mod:`experiments.step_times`); rank 0 changes its rate between rounds (``tc qdisc replace``, no
process restarts; ``unshaped`` is that loopback without a bucket).

Output (``--out``): ``rounds.json`` (every rank's step times) and ``step_times_<workload>_<optimizer>.json``,
rows as :mod:`experiments.step_times` writes them plus ``"integration": "horovod"`` and
``"link_mode": "shared"``. Run it alone on the machine::

    ../shared/tools/quiet python -m experiments.horovod_step_times --workload charlm-small --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

__all__ = ["main", "summarize"]

METHODS = ("noop", "dense", "fp16", "topk", "twobit", "start")
LINKS = ("unshaped", "1gbit", "100mbit", "10mbit")
#: ``GRADCOMP_QUEUE_DEFAULT``: the kernel's own queue limit, for the unshaped link (the namespace's was set).
QUEUE_DEFAULT_ENV = "GRADCOMP_QUEUE_DEFAULT"


def _set_link(rate: str) -> None:
    """Rank 0 sets the shared link's rate (``unshaped``: no bucket); every rank waits for it."""
    import horovod.torch as hvd

    from experiments import netem_tbf

    if hvd.rank() == 0:
        netem_tbf.set_shared_rate(os.environ["GRADCOMP_NETNS"], None if rate == "unshaped" else rate,
                                  int(os.environ[QUEUE_DEFAULT_ENV]))
    hvd.barrier()


def _replica(method: str, net, loop, run_steps: int):
    """``(model, distributed optimizer, scheduler, gradcomp optimizer or None)`` of ``method`` on a copy of ``net``."""
    import copy

    from experiments import loop as loops
    from experiments.horovod_train import study_optimizer
    from experiments.step_times import PLANNED_STEPS, START_PLANNED_STEPS

    model = copy.deepcopy(net)
    optimizer, scheduler = loops.build_optimizer(loop, model)
    if method == "noop":
        return model, optimizer, scheduler, None
    start = method == "start"  # the top-k recipe inside its dense start: its fp16 casts
    wrapped, stock = study_optimizer("topk" if start else method, model, optimizer, None if start else scheduler,
                                     START_PLANNED_STEPS if start else PLANNED_STEPS, run_steps, prefix=f"{method}.")
    return model, wrapped, scheduler, wrapped if stock is None else None


def _step(replica, workload, loop, rank: int, step: int) -> float:
    """One timed optimizer step of a replica; seconds (its batch drawn and the ranks met before the clock starts)."""
    import horovod.torch as hvd

    from experiments import loop as loops

    model, optimizer, scheduler, _ = replica
    batches = loops.micro_batches(workload, loop, rank, step, workload.default_batch_size)
    hvd.barrier()
    return loops.timed_optimizer_step(model, workload, loop, optimizer, scheduler, batches, step)[1]


def _agreed(count: int) -> int:
    """The largest of every rank's ``count``."""
    import horovod.torch as hvd
    import torch

    return int(hvd.allreduce(torch.tensor([count]), op=hvd.Max, name="gradcomp.round_steps").item())


def bench_rank(args) -> None:
    """One Horovod rank of the benchmark; rank 0 writes ``rounds.json`` (every rank's step times, per round)."""
    import warnings

    import horovod.torch as hvd

    from experiments import launch, suite
    from experiments import loop as loops
    from experiments.step_times import PLANNED_STEPS, _to_final_setting, timed_rounds

    warnings.filterwarnings("ignore")
    hvd.init()
    rank = hvd.rank()
    launch.rank_device(rank, 1, cuda=False)
    workload = suite.build(args.workload, 0, 32)
    loop = loops.loop_for(args.workload, args.optimizer, PLANNED_STEPS)
    if loop.clip or loop.accumulation > 1:
        raise SystemExit(f"horovod_step_times: {args.workload}'s loop clips or accumulates (not wired under Horovod)")
    net = workload.build_model()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    methods = args.methods.split(",")
    run_steps = args.run_steps or suite.STEPS[args.workload]
    replicas = {(m, None): _replica(m, net, loop, run_steps) for m in methods}
    counter = {key: 0 for key in replicas}

    def timed(key) -> float:
        counter[key] += 1
        return _step(replicas[key], workload, loop, rank, counter[key] - 1)

    _set_link("unshaped")
    for key, replica in replicas.items():
        _to_final_setting(replica, lambda count, key=key: sum(timed(key) for _ in range(count)), key[0])
    times = timed_rounds(lambda rate: {m: (m, None) for m in methods}, timed, _set_link, _agreed, args)
    gathered = hvd.allgather_object({f"{m}|{r}": v for (m, r), v in times.items()}, name="gradcomp.rounds")
    if rank == 0:
        with open(os.path.join(args.out, "rounds.json"), "w") as f:
            json.dump(gathered, f)
    hvd.barrier()
    hvd.shutdown()


def summarize(gathered: List[dict], args, load_before) -> List[dict]:
    """:func:`experiments.step_times.summarize`'s rows, marked as Horovod's over the shared link."""
    from experiments import step_times

    return [{**row, "integration": "horovod", "link_mode": "shared"}
            for row in step_times.summarize(gathered, args, load_before)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.horovod_step_times",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="charlm-small")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method, link and round")
    parser.add_argument("--round-seconds", type=float, default=0.0, help="a round's timed steps on one link take "
                        "about this long, all methods together (steps per method: at least --steps)")
    parser.add_argument("--settle", type=int, default=2, help="untimed steps after each link change")
    parser.add_argument("--run-steps", type=int, default=200, help="the run whose recipe is timed: its length "
                        "decides the 2-bit code (the Horovod convergence run's 200 steps)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole launch")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if "dense" not in args.methods.split(","):
        parser.error("--methods must include dense (every ratio is to it)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.rank:
        bench_rank(args)
        return 0
    from experiments import launch, netem
    from experiments.horovod_train import horovodrun_command

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = list(argv if argv is not None else sys.argv[1:])
    with netem.link("10gbit") as link:
        if not link.shaped:
            print("horovod_step_times: no emulated link (needs root); nothing measured", file=sys.stderr)
            return 1
        env = link.env()
        with open("/proc/sys/net/ipv4/tcp_limit_output_bytes") as f:  # the host's: the kernel's default
            env[QUEUE_DEFAULT_ENV] = f.read().strip()
        env.update(PYTHONPATH=root, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        command = horovodrun_command(argv + ["--rank"], module="experiments.horovod_step_times")
        status = launch.run_bounded(link.command(command), timeout=args.timeout, env=env, cwd=root)
    if status != 0:
        print(f"horovod_step_times: horovodrun exited with {status}", file=sys.stderr)
        return 1
    with open(os.path.join(args.out, "rounds.json")) as f:
        rows = summarize(json.load(f), args, os.environ.get("QUIET_LOAD_BEFORE"))
    with open(os.path.join(args.out, f"step_times_{args.workload}_{args.optimizer}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for row in sorted(rows, key=lambda r: (LINKS.index(r["link"]) if r["link"] in LINKS else 9, r["method"])):
        paired = (f"  {row['ratio_vs_dense']:.3f}x dense (paired, spread {row['ratio_spread']:.1%})"
                  if "ratio_vs_dense" in row else "")
        print(f"{row['link']:>9} {row['method']:>7} {1000 * row['step_time']:8.1f} ms  spread {row['spread']:.1%}"
              + paired)
    return 0


if __name__ == "__main__":
    sys.exit(main())
