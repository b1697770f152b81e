"""How a workload is trained: the optimizer, its learning rate and the patterns of the loop.

A :class:`Loop` states what a training script does around ``backward()`` and ``optimizer.step()``,
so that every experiment (the real DDP ranks and the in-process simulation) runs the same loop,
with the patterns real scripts use: a learning rate set by hand in ``param_groups`` or by an LR
scheduler, two param groups with weight decay on matrices only, gradient accumulation,
``clip_grad_norm_``. :func:`loop_for` gives each workload its loop; :func:`optimizer_step` is one
step of it on a DDP or FSDP rank, over the micro-batches of :func:`micro_batches`;
:func:`timed_optimizer_step` is that step with the wall clock around it (what the runner and the
step-time benchmarks time).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Optional, Tuple

import torch

__all__ = ["Loop", "loop_for", "build_optimizer", "lr_at", "before_step", "micro_batches", "optimizer_step",
           "timed_optimizer_step"]


@dataclass(frozen=True)
class Loop:
    """One workload's training loop.

    ``optimizer``: ``"adamw"`` or ``"sgdm"`` (SGD, momentum 0.9); ``lr``: the peak learning rate;
    ``warmup``: linear warm-up steps, then a cosine decay to a tenth of the peak at ``steps``;
    ``manual_lr``: the script sets ``param_group["lr"]`` itself each step (no scheduler object);
    ``clip``: ``clip_grad_norm_`` max norm (0: none); ``accumulation``: micro-batches per optimizer
    step; ``decay_groups``: weight decay on parameters of 2+ dimensions only (two param groups).
    """

    optimizer: str
    lr: float
    steps: int
    warmup: int
    manual_lr: bool = False
    clip: float = 0.0
    accumulation: int = 1
    decay_groups: bool = False
    weight_decay: float = 0.0
    betas: Tuple[float, float] = (0.9, 0.999)
    momentum: float = 0.9

    def describe(self) -> dict:
        return asdict(self)


#: Peak learning rates per workload and optimizer (the workloads' own, not tuned for compression).
PEAK_LR = {"adamw": 1e-3, "sgdm": 0.1}
PEAK_LR_OVERRIDES = {("digits", "sgdm"): 0.05, ("digits-mlp", "sgdm"): 0.05, ("shapes", "sgdm"): 0.05}


def loop_for(workload: str, optimizer: str, steps: int, **overrides) -> Loop:
    """The loop of ``workload`` trained with ``optimizer`` for ``steps`` optimizer steps: a warm-up
    of ``min(20, steps // 10)`` steps; the GPT workload adds its script's patterns (``gpt.LOOP``;
    ``gpt-noclip``: all but the clip), its weight decay under SGD made SGD's equivalent
    (:func:`sgd_weight_decay`)."""
    lr = PEAK_LR_OVERRIDES.get((workload, optimizer), PEAK_LR[optimizer])
    loop = Loop(optimizer, lr, steps, min(20, steps // 10))
    if workload in ("gpt", "gpt-noclip"):
        from experiments.gpt import LOOP

        loop = replace(loop, **{**LOOP, **({"clip": 0.0} if workload == "gpt-noclip" else {})})
        if optimizer == "sgdm":
            loop = replace(loop, weight_decay=sgd_weight_decay(LOOP["weight_decay"], loop))
    return replace(loop, **overrides)


def sgd_weight_decay(adamw_weight_decay: float, loop: Loop) -> float:
    """SGD's L2 ``weight_decay`` that shrinks a weight as much per step at ``loop``'s peak rate as AdamW's
    decoupled ``adamw_weight_decay`` does at AdamW's peak rate (``lr * wd`` a step).

    The GPT script's 0.1 is AdamW's decoupled decay: 1e-4 a step at LR 1e-3. torch's SGD adds
    ``wd * p`` to the gradient, which momentum then sums over about ``1 / (1 - beta)`` steps, so the
    same shrink at LR 0.1 and beta 0.9 is ``wd = 1e-4``. Taken literally, 0.1 as SGD's L2 at LR 0.1 is a
    ~10 % shrink a step: in dense training the attention weights of the first block fell from a norm of
    4.4 to 0.08 in 100 steps and the held-out loss ended 25 % above the same run without decay."""
    return adamw_weight_decay * PEAK_LR["adamw"] * (1 - loop.momentum) / loop.lr


def lr_at(loop: Loop, step: int) -> float:
    """Linear warm-up over ``loop.warmup`` steps, then cosine decay to 10% of the peak at the last step."""
    if step < loop.warmup:
        return loop.lr * (step + 1) / loop.warmup
    progress = (step - loop.warmup) / max(1, loop.steps - loop.warmup)
    return loop.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def param_groups(loop: Loop, model: torch.nn.Module):
    """One group, or (``decay_groups``) matrices with weight decay and the rest without."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not loop.decay_groups:
        return [{"params": params, "weight_decay": loop.weight_decay}]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": loop.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizer(loop: Loop, model: torch.nn.Module):
    """``(optimizer, scheduler)``; the scheduler is ``None`` when the loop sets the rate by hand."""
    groups = param_groups(loop, model)
    if loop.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=loop.lr, betas=loop.betas)
    elif loop.optimizer == "sgdm":
        optimizer = torch.optim.SGD(groups, lr=loop.lr, momentum=loop.momentum)
    else:
        raise ValueError(f"unknown optimizer {loop.optimizer!r}")
    if loop.manual_lr:
        set_lr(loop, optimizer, 0)
        return optimizer, None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(loop, step) / loop.lr)
    return optimizer, scheduler


def set_lr(loop: Loop, optimizer, step: int) -> None:
    """What a script that sets the rate by hand does before each step."""
    for group in optimizer.param_groups:
        group["lr"] = lr_at(loop, step)


def before_step(loop: Loop, model: torch.nn.Module, optimizer, scaler=None) -> Optional[float]:
    """What the loop does between ``backward()`` and ``optimizer.step()``: unscale and clip.
    Returns the gradient norm the clip measured (``None`` without a clip)."""
    if not loop.clip:
        return None
    if scaler is not None:
        scaler.unscale_(optimizer)
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip))


def micro_batches(workload, loop: Loop, rank: int, step: int, batch_size: int, device=None) -> list:
    """This rank's ``(x, y)`` micro-batches of optimizer step ``step`` (``loop.accumulation`` of them),
    on ``device``."""
    micro = loop.accumulation
    batches = [workload.batch(rank, step * micro + m, batch_size) for m in range(micro)]
    return batches if device is None else [(x.to(device), y.to(device)) for x, y in batches]


def _syncing(model, last: bool):
    """Gradient synchronisation only on the last micro-batch: DDP's ``no_sync()`` before it, FSDP's
    ``set_requires_gradient_sync``."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    return model.no_sync() if not last else contextlib.nullcontext()


def optimizer_step(model, workload, loop: Loop, optimizer, scheduler, batches: list, step: int) -> float:
    """One optimizer step of the workload's loop on a DDP or FSDP ``model`` over ``batches`` (accumulated,
    synchronised on the last); the mean loss of the micro-batches. Mutates the model, the optimizer
    and the scheduler; leaves every ``.grad`` ``None``."""
    if loop.manual_lr:
        set_lr(loop, optimizer, step)
    micro, losses = len(batches), []
    for m, (x, y) in enumerate(batches):
        with _syncing(model, m == micro - 1):
            loss = workload.loss(model, x, y)
            (loss / micro).backward()
        losses.append(float(loss.detach()))
    before_step(loop, model, optimizer)  # FSDP: clip_grad_norm_ on the DTensors, whose .grad is the average
    optimizer.step()
    # torch's default sets every .grad to None; Horovod's DistributedOptimizer takes no argument here.
    optimizer.zero_grad()
    if scheduler is not None:
        scheduler.step()
    return sum(losses) / micro


def timed_optimizer_step(model, workload, loop: Loop, optimizer, scheduler, batches: list, step: int,
                         device=None) -> Tuple[float, float]:
    """:func:`optimizer_step` timed: ``(mean loss, seconds)``. The clock starts after the batches were
    drawn and, on a CUDA ``device``, stops after the device is synchronised. Mutates what
    :func:`optimizer_step` mutates."""
    started = time.perf_counter()
    loss = optimizer_step(model, workload, loop, optimizer, scheduler, batches, step)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return loss, time.perf_counter() - started
