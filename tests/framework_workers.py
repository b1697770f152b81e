"""Rank entry points for tests/test_frameworks.py (real Gloo, spawned by ``multiprocess.spawn``), and
the recipe run that every framework's script reproduces (:func:`recipe_hand_written`)."""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_workers as workers
import gradcomp
from gradcomp.hooks import ddp as gc_ddp

# The settings tests/lightning_train.py uses, so the hand-written loop is the same training.
LR, MOMENTUM, WARMUP, MIN_NUMEL = 0.05, 0.9, 1, 16
# The recipe run (AdamW under an LR warm-up, clipping, accumulation) that the Accelerate and Lightning
# scripts reproduce. A byte budget of 1.5x lets the dense start follow the warm-up, so a scheduler read
# at the wrong pace changes the plan (and the final parameters).
RECIPE_LR, RECIPE_WARMUP, CLIP, MIN_COMPRESSION, ACCUMULATE = 0.01, 4, 1.0, 1.5, 2


def warmup(step: int) -> float:
    """The LR factor at optimizer step ``step``: a linear warm-up over :data:`RECIPE_WARMUP` steps."""
    return min(1.0, (step + 1) / RECIPE_WARMUP)


def recipe_kwargs(steps: int) -> dict:
    """The recipe's arguments besides optimizer and scheduler, the same in every framework's run."""
    return {"total_steps": steps, "min_compression": MIN_COMPRESSION, "min_numel": MIN_NUMEL, "backend": "torch"}


def held_out(model) -> float:
    x, y = workers.batch(99, 999, n=256)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x), y).item()


def result(model, state) -> dict:
    """What a run reports: final parameters, held-out loss, the engine's step, the plan and totals."""
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "held_out": held_out(model),
            "step": state.step, "dense_steps": state.recipe.dense_steps if state.recipe else None,
            "stats": state.stats()["total"]}  # fmt: skip


def recipe_hand_written(rank, world_size, spec, steps, accumulate):
    """The plain DDP loop with the one-call recipe: AdamW, a per-step warm-up, ``no_sync`` accumulation
    of ``accumulate`` micro-batches (``ddp_workers.batch(rank, step * accumulate + micro)``), clipping."""
    model = workers.make_model("mlp")
    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=RECIPE_LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    state = gradcomp.register(ddp, spec, optimizer=optimizer, scheduler=scheduler, **recipe_kwargs(steps))
    for step in range(steps):
        for micro in range(accumulate):
            x, y = workers.batch(rank, step * accumulate + micro)
            with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                (torch.nn.functional.mse_loss(ddp(x), y) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return result(model, state)


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


def snapshot(state) -> dict:
    """``state.state_dict()`` flattened and copied, to compare before and after a backward pass."""
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in _flat(state.state_dict()).items()}


def same(before: dict, after: dict) -> bool:
    return before.keys() == after.keys() and all(
        torch.equal(b, after[k]) if torch.is_tensor(b) else b == after[k] for k, b in before.items())


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
