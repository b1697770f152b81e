"""One Horovod rank of the recipe's cross-path test: the one-call recipe through the drop-in
``DistributedOptimizer``, on the model, data and settings of ``recipe_workers`` (the DDP side).

Usage: ``horovodrun -np 2 --gloo -H localhost:2 python tests/recipe_horovod_worker.py OUT_DIR``;
each rank writes ``OUT_DIR/rank{r}.pt`` with one entry per case of :data:`CASES`.
"""
import os
import sys

import horovod.torch as hvd
import torch

import recipe_workers as workers
from gradcomp.hooks import horovod as gc_hvd

CASES = (("sgd", "topk:0.01"), ("adamw", "twobit:rms"), ("sgd", "twobit:rms"))


def train(kind: str, spec: str, rank: int) -> dict:
    model = workers.make_model()
    optimizer = workers.make_optimizer(kind, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (workers.LR_WARMUP + 1)))
    optimizer = gc_hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=gradcomp_compressor(spec), total_steps=workers.TOTAL_STEPS,
                                            scheduler=scheduler, min_numel=workers.MIN_NUMEL,
                                            min_compression=workers.MIN_COMPRESSION,
                                            num_groups=1)  # one group, as DDP's one bucket
    for step in range(workers.TOTAL_STEPS):
        optimizer.zero_grad()
        x, y = workers.batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "dense_steps": optimizer.recipe.dense_steps, "stats": optimizer.stats()["total"],
            "residual_decay": optimizer.engine.residual_decay}


def gradcomp_compressor(spec: str):
    import gradcomp

    return gradcomp.from_spec(spec)


def main(out_dir: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    results = {f"{kind}-{spec}": train(kind, spec, hvd.rank()) for kind, spec in CASES}
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
