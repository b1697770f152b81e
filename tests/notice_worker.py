"""One rank of a script that configures no logging and registers gradcomp's recipe (run as a
subprocess by ``test_notices.py``): ``python notice_worker.py RANK WORLD PORT [silence]``."""
import os
import sys
import warnings

import torch
import torch.distributed as dist

import gradcomp


def main(rank: int, world_size: int, port: int, silence: bool) -> None:
    if silence:
        warnings.simplefilter("ignore", gradcomp.RecipeNotice)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters())
    gradcomp.register(ddp, "twobit:rms", optimizer=optimizer, total_steps=3)
    for step in range(4):  # one step past the plan
        ddp(torch.randn(8, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), len(sys.argv) > 4)
