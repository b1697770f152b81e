"""A tiny real 2-rank Gloo job for the duplex link test: ``python netem_workers.py RANK WORLD PORT [join]``.

With ``join``, the rank moves itself into its namespace (``experiments.netem.join_rank_namespace``)
instead of being started inside it by ``ip netns exec``. Prints one line ``ok <rank> <address>``.
"""
import datetime
import os
import sys

from experiments import netem


def main(rank: int, world_size: int, port: int, join: bool) -> None:
    if join:
        netem.join_rank_namespace(rank)
    import torch
    import torch.distributed as dist

    from gradcomp import inflight

    torch.set_num_threads(1)
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        tensor = torch.full((1 << 18,), float(rank + 1))  # 1 MB
        for _ in range(3):
            total = tensor.clone()
            (handed,) = inflight.hold(total)  # Gloo's thread must not be its last owner at exit
            dist.all_reduce(handed)
            expected = world_size * (world_size + 1) / 2
            if not bool((total == expected).all()):
                raise SystemExit(f"rank {rank}: allreduce gave {total[:4].tolist()}, expected {expected}")
        inflight.all_gather_object(os.environ["MASTER_ADDR"])  # held: the job's last collective
    finally:
        dist.destroy_process_group()
    print(f"ok {rank} {os.environ['GLOO_SOCKET_IFNAME']}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["join"])
