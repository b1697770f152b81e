"""One rank of the late-rank test (``test_netem_duplex.py``): ``python netem_late_worker.py RANK PORT KIND``.

Both ranks meet at a barrier; rank 1 then waits 30 ms more, and each gathers 121,000 bytes, by Gloo's
own allgather (``KIND`` ``gloo``) or gradcomp's DDP transport (``gradcomp``: receives posted first).
Three repeats; rank 1 prints ``late <ms>``, the median of its gathers' times.
"""
import datetime
import os
import statistics
import sys
import time

NBYTES = 121_000
LAG_S = 0.03


def main(rank: int, port: int, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from gradcomp import inflight
    from gradcomp.hooks.ddp import TorchDistributedTransport

    torch.set_num_threads(1)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    transport, seconds = TorchDistributedTransport(), []
    try:
        for _ in range(3):
            dist.barrier()
            time.sleep(0.1 + (LAG_S if rank == 1 else 0.0))
            payload = torch.full((NBYTES,), rank, dtype=torch.uint8)
            start = time.perf_counter()
            if kind == "gloo":
                gathered = torch.empty(2 * NBYTES, dtype=torch.uint8)
                sent, received = inflight.hold(payload, gathered)  # Gloo's thread must not be their last owner
                dist.all_gather_into_tensor(received, sent)
            else:
                (gathered,) = transport.allgather(payload, "group").wait()
            seconds.append(time.perf_counter() - start)
            if not (gathered[:NBYTES].eq(0).all() and gathered[NBYTES:].eq(1).all()):
                raise SystemExit(f"rank {rank}: the gathered bytes are not rank 0's then rank 1's")
        inflight.all_gather_object(rank)  # held: the job's last collective
    finally:
        dist.destroy_process_group()
    if rank == 1:
        print(f"late {statistics.median(seconds) * 1e3:.1f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
