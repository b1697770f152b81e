"""One Horovod rank of the recipe's cross-path test: the one-call recipe through the drop-in
``DistributedOptimizer``, on the model, data and settings of ``recipe_workers`` (the DDP side).

Usage: ``horovodrun -np 2 --gloo -H localhost:2 python tests/recipe_horovod_worker.py OUT_DIR``;
each rank writes ``OUT_DIR/rank{r}.pt`` with one entry per case of :data:`CASES`, and ``"late-freeze"``: the
run of ``test_freeze_gate.simulate_late_freeze`` (a hand-set warm-up Adam's freeze waits for, the byte budget then
kept by a code switch) through the same optimizer.
"""
import os
import sys

import horovod.torch as hvd
import test_freeze_gate as gate
import torch

import recipe_workers as workers
from gradcomp.hooks import horovod as gc_hvd

CASES = (("sgd", "topk:0.01"), ("adamw", "twobit:rms"), ("sgd", "twobit:rms"), ("adamw", "topk:0.01"))


def train(kind: str, spec: str, rank: int) -> dict:
    model = workers.make_model()
    optimizer = workers.make_optimizer(kind, model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (workers.LR_WARMUP + 1)))
    optimizer = gc_hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=gradcomp_compressor(spec), total_steps=workers.TOTAL_STEPS,
                                            scheduler=scheduler, min_numel=workers.MIN_NUMEL,
                                            min_compression=workers.MIN_COMPRESSION)  # the default groups: DDP's
    for step in range(workers.TOTAL_STEPS):
        optimizer.zero_grad()
        x, y = workers.batch(rank, step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        scheduler.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "dense_steps": optimizer.recipe.dense_steps, "stats": optimizer.stats()["total"],
            "residual_decay": optimizer.engine.residual_decay}


def train_late_freeze(rank: int) -> dict:
    """``test_freeze_gate.simulate_late_freeze``'s run, this rank's share of it, through Horovod."""
    model = gate.late_model()
    optimizer = gc_hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()),
                                            named_parameters=model.named_parameters(),
                                            compression=gradcomp_compressor("twobit"), total_steps=gate.LATE_STEPS,
                                            num_groups=1)  # one group, as the simulation's one bucket
    generator, used = torch.Generator().manual_seed(2), []
    for step in range(gate.LATE_STEPS):
        gate.set_rate(optimizer, gate.hand_set(step, gate.LATE_WARMUP, gate.LATE_PEAK))
        optimizer.zero_grad()
        used.append(type(optimizer.engine.compressor_now()).__name__)
        gate.late_loss(model, gate.late_batches(generator)[rank]).backward()
        optimizer.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "used": used,
            "opened": optimizer.engine.transform.gate.opened, "stats": optimizer.stats()["total"]}


def gradcomp_compressor(spec: str):
    import gradcomp

    return gradcomp.from_spec(spec)


def main(out_dir: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    results = {f"{kind}-{spec}": train(kind, spec, hvd.rank()) for kind, spec in CASES}
    results["late-freeze"] = train_late_freeze(hvd.rank())
    torch.save(results, os.path.join(out_dir, f"rank{hvd.rank()}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
