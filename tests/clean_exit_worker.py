"""One rank of a tiny DDP job over Gloo that ends like a user's script: no cleanup beyond
``destroy_process_group()``, then a normal interpreter exit (see tests/test_clean_exit.py).

Usage: ``python tests/clean_exit_worker.py RANK WORLD_SIZE PORT COMPRESSOR`` (``topk`` or ``twobit``).
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp


def main(rank: int, world_size: int, port: int, compressor: str) -> None:
    # A long switch interval keeps the GIL with this (main) thread after backward() returns,
    # so Gloo's thread, which releases the collective's objects right after completing its
    # future, is as late as a starved thread on a loaded machine: the exit race at its widest.
    sys.setswitchinterval(30.0)
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    ddp = DDP(model)
    spec = gradcomp.TopK(0.05) if compressor == "topk" else gradcomp.TwoBit(0.01)
    # Every bucket compressed from the first step: Numba's parallel decode runs in Gloo's
    # callback thread at every step, the last one included.
    gc_ddp.register(ddp, spec, warmup_steps=0, min_numel=0, backend="numba")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        optimizer.zero_grad()
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
