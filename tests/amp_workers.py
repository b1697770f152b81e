"""Rank workers for mixed precision with a real ``torch.amp.GradScaler`` (on CPU): the same run
with and without the scaler, with its scale growing, and with an overflow that makes it back off."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp
from recipe_workers import MIN_NUMEL, batch, make_model

STEPS = 24


def train_worker(rank, world_size, scaled: bool, overflow_at=None, recipe: bool = True):
    """Train :data:`STEPS` steps; with ``scaled`` through a GradScaler whose scale starts at 2^8 and
    doubles every 3 clean steps. ``overflow_at``: the step at which rank 1's loss is made infinite
    (with the scaler) or which is left out entirely (without it). Returns parameters, scales and
    this rank's residuals after every step."""
    model = make_model()
    ddp = DDP(model)
    momentum = 0.9 if recipe else 0.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3) if scaled else None
    if recipe:
        state = gc_ddp.register(ddp, "topk:0.05", optimizer=optimizer, total_steps=STEPS, min_numel=MIN_NUMEL,
                                grad_scaler=scaler)
    else:
        state = gc_ddp.register(ddp, gradcomp.TopK(0.05), warmup_steps=2, min_numel=MIN_NUMEL, grad_scaler=scaler)
    scales, residuals = [], []
    for step in range(STEPS):
        if step == overflow_at and not scaled:
            continue
        optimizer.zero_grad()
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if scaled:
            if step == overflow_at and rank == 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(float(scaler.get_scale()))
        else:
            loss.backward()
            optimizer.step()
        residuals.append({k: v.clone() for k, v in state.state_dict()["residuals"].items()})
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "scales": scales,
            "residuals": residuals}
