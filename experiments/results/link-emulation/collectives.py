"""Gloo's collectives between two ranks over an emulated duplex link, against their time at the rate.

    ../shared/tools/heavy env PYTHONPATH=. python experiments/results/link-emulation/collectives.py [--before] RATE...

(from the repository root).

Per rate: a float32 allreduce of 1.75 MB (charlm-small's gradient) and uint8 allgathers of 164,000 and
50,000 bytes (about its 2-bit and top-k payloads), each started 0.1 s after a barrier, as a step's exchange
follows its compute; six repeats, the first dropped; rank 0's milliseconds. ``--before`` shapes the link as
``experiments.netem`` did before cec77e6 (a 128 KB bucket, a 100 ms queue, the kernel's own offload
packets and queued bytes). Informal: run under ``heavy``, not ``quiet``.
"""
import argparse
import statistics
import sys
import time

COLLECTIVES = (("allreduce", 1_750_000), ("allgather", 164_000), ("allgather", 50_000))


def rank_main(rank: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for kind, nbytes in COLLECTIVES:
        seconds = []
        for _ in range(6):
            dist.barrier()
            time.sleep(0.1)
            start = time.perf_counter()
            if kind == "allreduce":
                dist.all_reduce(torch.ones(nbytes // 4))
            else:
                dist.all_gather_into_tensor(torch.empty(2 * nbytes, dtype=torch.uint8),
                                            torch.ones(nbytes, dtype=torch.uint8))
            seconds.append(time.perf_counter() - start)
        if rank == 0:
            ms = [s * 1e3 for s in seconds[1:]]
            print(f"  {kind} {nbytes:>9,} B: median {statistics.median(ms):7.1f} ms, repeats "
                  f"{' '.join(f'{m:.0f}' for m in ms)}", flush=True)
    dist.destroy_process_group()


def shape_as_before() -> None:
    """``experiments.netem`` before cec77e6: a 128 KB bucket, a 100 ms queue, the stack's defaults."""
    from experiments import netem_tbf

    netem_tbf.tbf_args = lambda rate: ["tbf", "rate", rate, "burst", "128kb", "latency", "100ms"]
    netem_tbf.stack_settings = lambda rate, default: (netem_tbf.GSO_MAX_SEGS, default)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rates", nargs="*")
    parser.add_argument("--before", action="store_true")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank)
        return 0
    if not args.rates:
        parser.error("name at least one rate (10mbit, 100mbit, 1gbit, ...)")
    from experiments import launch, netem, netem_tbf

    if args.before:
        shape_as_before()
    for rate in args.rates:
        per_s = netem_tbf.rate_bytes_per_s(rate)
        # At the rate: an allreduce of two ranks sends the whole tensor each way (half, twice); an allgather its
        # payload; TCP/IP's headers take 66 bytes of each 1,514 on the wire.
        at_rate = ", ".join(f"{kind} {n / per_s * 1514 / 1448 * 1e3:.1f} ms" for kind, n in COLLECTIVES)
        print(f"{rate} ({'before' if args.before else 'now'}); at the rate: {at_rate}", flush=True)
        with netem.link(rate, mode="duplex", ranks=2) as link:
            env = dict(link.env(), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            codes, _ = launch.run_commands([link.rank_command(r, [sys.executable, __file__, "--rank", str(r)])
                                            for r in range(2)], timeout=600, env=env)
        if codes != [0, 0]:
            print(f"ranks exited with {codes}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
