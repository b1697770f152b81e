"""A rank that starts an allgather after its peer, over an emulated duplex link: Gloo's against gradcomp's.

    ../shared/tools/heavy env PYTHONPATH=. python experiments/results/link-emulation/late_rank.py RATE...

(from the repository root).

Per rate, payload (121,000 and 50,000 bytes: about the 2-bit recipe's larger group and top-k's whole step on
charlm-small) and lag (rank 1 starts 0 or 30 ms after rank 0, both 0.1 s after a barrier): six repeats of
Gloo's allgather (``all_gather_into_tensor``) and of gradcomp's DDP transport (``TorchDistributedTransport.
allgather``: every receive posted before any send, ``gradcomp.hooks.direct``), the first dropped. Each rank's
finish in ms after the later rank's start, the median of five, beside the payload's time at the rate.
Informal: run under ``heavy``, not ``quiet``.
"""
import argparse
import statistics
import sys
import time

PAYLOADS = (121_000, 50_000)
LAGS = (0.0, 0.03)
KINDS = ("gloo", "gradcomp")


def rank_main(rank: int, lag: float, nbytes: int, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from gradcomp.hooks.ddp import TorchDistributedTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    transport = TorchDistributedTransport()
    times = []
    for _ in range(6):
        dist.barrier()
        time.sleep(0.1 + (lag if rank == 1 else 0.0))
        payload = torch.full((nbytes,), rank, dtype=torch.uint8)
        start = time.perf_counter()
        if kind == "gloo":
            gathered = torch.empty(2 * nbytes, dtype=torch.uint8)
            dist.all_gather_into_tensor(gathered, payload)
        else:
            (gathered,) = transport.allgather(payload, "group").wait()
        times.append((start, time.perf_counter()))
        assert gathered[:nbytes].eq(0).all() and gathered[nbytes:].eq(1).all()
    every = [None, None]
    dist.all_gather_object(every, times)
    if rank == 0:
        after = [[(every[r][i][1] - max(every[0][i][0], every[1][i][0])) * 1e3 for i in range(1, 6)] for r in range(2)]
        each = [f"rank {r} {statistics.median(after[r]):5.0f} ms ({' '.join(f'{m:.0f}' for m in after[r])})"
                for r in range(2)]
        print(f"  {kind:>8} {nbytes:>7,} B, rank 1 {lag * 1e3:2.0f} ms late: {', '.join(each)}", flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rates", nargs="*")
    parser.add_argument("--rank", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank, lag, nbytes, kind = args.rank
        rank_main(int(rank), float(lag), int(nbytes), kind)
        return 0
    if not args.rates:
        parser.error("name at least one rate (10mbit, 100mbit, 1gbit, ...)")
    from experiments import launch, netem, netem_tbf

    for rate in args.rates:
        per_s = netem_tbf.rate_bytes_per_s(rate)
        at_rate = ", ".join(f"{n:,} B {n / per_s * 1514 / 1448 * 1e3:.1f} ms" for n in PAYLOADS)
        print(f"{rate}; at the rate: {at_rate}", flush=True)
        with netem.link(rate, mode="duplex", ranks=2) as link:
            env = dict(link.env(), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            for nbytes in PAYLOADS:
                for lag in LAGS:
                    for kind in KINDS:
                        argv = [sys.executable, __file__, "--rank"]
                        codes, _ = launch.run_commands(
                            [link.rank_command(r, argv + [str(r), str(lag), str(nbytes), kind]) for r in range(2)],
                            timeout=600, env=env)
                        if codes != [0, 0]:
                            print(f"ranks exited with {codes}", file=sys.stderr)
                            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
