"""Rank entry points for tests/test_frameworks.py (real Gloo, spawned by ``multiprocess.spawn``)."""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_workers as workers
from gradcomp.hooks import ddp as gc_ddp

# The settings tests/lightning_train.py uses, so the hand-written loop is the same training.
LR, MOMENTUM, WARMUP, MIN_NUMEL = 0.05, 0.9, 1, 16


def hand_written(rank, world_size, spec, steps):
    """The plain DDP loop that tests/lightning_train.py must reproduce: final params and held-out loss."""
    torch.manual_seed(0)
    model = workers.make_model("mlp")
    ddp = DDP(model)
    state = gc_ddp.register(ddp, workers.make_compressor(spec), warmup_steps=WARMUP, min_numel=MIN_NUMEL,
                            backend="torch")  # fmt: skip
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = workers.batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    x, y = workers.batch(99, 999, n=256)
    with torch.no_grad():
        held_out = torch.nn.functional.mse_loss(model(x), y).item()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "held_out": held_out,
            "step": state.step}  # fmt: skip


def accumulation(rank, world_size, spec, optimizer_steps, micro_steps):
    """Gradient accumulation with ``no_sync``: ``micro_steps - 1`` backward passes under ``no_sync``,
    then one synchronised pass and an optimizer step. Records, per backward pass,
    the engine step and whether the residuals changed."""
    model = workers.make_model("mlp")
    ddp = DDP(model)
    state = gc_ddp.register(ddp, workers.make_compressor(spec), warmup_steps=1, min_numel=16, backend="torch")

    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    records = []

    def snapshot():
        sd = state.state_dict()
        return {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat(sd).items()}

    for step in range(optimizer_steps):
        optimizer.zero_grad()
        for micro in range(micro_steps):
            before = snapshot()
            x, y = workers.batch(rank, step * micro_steps + micro)
            # DDP decides in the forward whether the backward syncs: the forward belongs inside no_sync.
            context = ddp.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext()
            with context:
                (torch.nn.functional.mse_loss(ddp(x), y) / micro_steps).backward()
            after = snapshot()
            unchanged = before.keys() == after.keys() and all(
                torch.equal(b, after[k]) if torch.is_tensor(b) else b == after[k] for k, b in before.items()
            )
            records.append({"synced": micro == micro_steps - 1, "engine_step": state.step,
                            "residuals_unchanged": unchanged})  # fmt: skip
        optimizer.step()
    return {"records": records, "stats_steps": state.stats()["total"]["steps"], "step": state.step}


def _flat(tree, prefix=""):
    """A nested state dict as ``{"a/b/c": leaf}`` so two snapshots compare leaf by leaf."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}/{i}"))
    else:
        out[prefix] = tree
    return out
