"""Consecutive steps of one recipe, as a training run takes them: Gloo's allgather against gradcomp's.

    ../shared/tools/heavy env PYTHONPATH=. python experiments/results/link-emulation/steady_steps.py \
        [--workload charlm-small] [--optimizer adamw] [--steps 16] [RATE]

(from the repository root; RATE defaults to 10mbit, ``unshaped`` is the loopback).

One launch of 2 ranks over a duplex link holds the workload with the 2-bit and the top-k recipe at their final
setting (``experiments.step_times``' replicas). Then, for each recipe, four blocks in turn, ``gloo``
``gradcomp`` ``gloo`` ``gradcomp``: a barrier, 3 untimed steps, ``--steps`` timed steps one after the other with no
barrier between them (each rank starts a step when it has finished the one before, as in training). ``gloo``
takes the exchange through Gloo's own allgather (``gradcomp.hooks.direct.applies`` answers no), ``gradcomp``
through the transport as it ships (every receive posted first). Each block's figure: the slower rank's median
step; and how late the later rank started its steps, the median over the block. Informal: run under ``heavy``.
"""
import argparse
import statistics
import sys
import time

BLOCKS = ("gloo", "gradcomp", "gloo", "gradcomp")
METHODS = ("twobit", "topk")
UNTIMED = 3


def _block(replica, workload, loop, rank: int, counter: list, timed: int) -> list:
    """``UNTIMED`` then ``timed`` consecutive steps after a barrier; the timed ones' (start, end) on this rank."""
    import torch.distributed as dist

    from experiments import loop as loops

    ddp, optimizer, scheduler, _ = replica
    dist.barrier()
    spans = []
    for i in range(UNTIMED + timed):
        batches = loops.micro_batches(workload, loop, rank, counter[0], workload.default_batch_size)
        start = time.perf_counter()
        loops.optimizer_step(ddp, workload, loop, optimizer, scheduler, batches, counter[0])
        counter[0] += 1
        if i >= UNTIMED:
            spans.append((start, time.perf_counter()))
    return spans


def rank_main(rank: int, args) -> None:
    import torch.distributed as dist

    from experiments import launch, step_times, suite
    from experiments import loop as loops
    from gradcomp import inflight
    from gradcomp.hooks import direct

    launch.init_rank(rank, 2, threads=1, timeout=1800, cuda=False)
    workload = suite.build(args.workload, 0, 32)
    loop = loops.loop_for(args.workload, args.optimizer, step_times.PLANNED_STEPS)
    net = workload.build_model()
    shipped = direct.applies
    for method in METHODS:
        replica, counter = step_times._replica(method, net, loop, suite.STEPS[args.workload]), [0]

        def untimed(count, replica=replica, counter=counter) -> None:
            for _ in range(count):
                batches = loops.micro_batches(workload, loop, rank, counter[0], workload.default_batch_size)
                loops.optimizer_step(replica[0], workload, loop, replica[1], replica[2], batches, counter[0])
                counter[0] += 1

        step_times._agree_on_link("unshaped", rank)  # through the dense start and the ramp on the fast link
        step_times._to_final_setting(replica, untimed, method)
        step_times._agree_on_link(args.rate, rank)
        for block in BLOCKS:
            direct.applies = shipped if block == "gradcomp" else (lambda *args: False)
            spans = inflight.all_gather_object(_block(replica, workload, loop, rank, counter, args.steps))
            direct.applies = shipped
            if rank == 0:
                slower = [max(spans[r][i][1] - spans[r][i][0] for r in range(2)) for i in range(args.steps)]
                lag = [abs(spans[0][i][0] - spans[1][i][0]) for i in range(args.steps)]
                print(f"  {method:>6} {block:>8}: step {statistics.median(slower) * 1e3:6.1f} ms "
                      f"({min(slower) * 1e3:.0f}-{max(slower) * 1e3:.0f}), the later rank's start "
                      f"{statistics.median(lag) * 1e3:5.1f} ms after the other's", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rate", nargs="?", default="10mbit")
    parser.add_argument("--workload", default="charlm-small")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per block")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args)
        return 0
    from experiments import launch, netem

    print(f"{args.workload}, {args.optimizer}, {args.rate}: {args.steps} consecutive steps per block", flush=True)
    with netem.link("10gbit", mode="duplex", ranks=2) as link:  # the ranks set the rate (step_times' way)
        env = dict(link.env(), OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        argv = [sys.executable, __file__, args.rate, "--workload", args.workload, "--optimizer", args.optimizer,
                "--steps", str(args.steps), "--rank"]
        codes, _ = launch.run_commands([link.rank_command(r, argv + [str(r)]) for r in range(2)], timeout=1800, env=env)
    if codes != [0, 0]:
        print(f"ranks exited with {codes}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
