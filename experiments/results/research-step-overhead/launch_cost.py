"""What starting an asynchronous collective costs the calling thread, warm: Gloo's allgather of a 70,000-byte payload
(charlm-small's 3-bit group, about) against its allreduce of 218,880 float16 (the fp16 hook's group), 2 ranks on
the loopback, one thread each, a barrier before each start; medians of the wall time and of the thread's CPU time of
the start call alone. Informal. From the repository root::

    GLOO_SOCKET_IFNAME=lo PYTHONPATH=. python experiments/results/research-step-overhead/launch_cost.py [REPEATS]
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments import launch


def rank_main(rank: int, repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    payload, gathered = torch.zeros(70_000, dtype=torch.uint8), torch.empty(140_000, dtype=torch.uint8)
    half = torch.zeros(218_880, dtype=torch.float16)
    starts = {"allgather": lambda: dist.all_gather_into_tensor(gathered, payload, async_op=True),
              "allreduce": lambda: dist.all_reduce(half, async_op=True)}
    wall, cpu = {name: [] for name in starts}, {name: [] for name in starts}
    for _ in range(repeats):
        for name, start in starts.items():
            dist.barrier()
            began, began_cpu = time.perf_counter(), time.thread_time()
            work = start()
            wall[name].append(time.perf_counter() - began)
            cpu[name].append(time.thread_time() - began_cpu)
            work.wait()
    if rank == 0:
        for name in starts:
            skip = repeats // 5
            print(f"{name}: start {statistics.median(wall[name][skip:]) * 1e6:.0f} us wall, "
                  f"{statistics.median(cpu[name][skip:]) * 1e6:.0f} us CPU")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(launch.free_port())
    mp.spawn(rank_main, args=(int(sys.argv[1]) if len(sys.argv) > 1 else 300,), nprocs=2)
