"""What the recipe reads of the user's LR scheduler: the step its rate peaks at (the warm-up's end), read ahead on a
copy, from the run's first step where a resumed run has loaded the scheduler's state, and whether it can be read
ahead at all (``plannable``: not a scheduler that steps on the loop's metric).

Nothing here changes the scheduler or its optimizer: every reading steps a deep copy that shares the parameters and
the optimizer's state tensors.
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings

import torch

__all__ = ["lr_peak_step", "plannable", "rewind"]


def plannable(scheduler):
    """``scheduler`` where the plan can read its rates ahead (its ``step()`` takes no argument), else ``None``:
    ``ReduceLROnPlateau`` steps on the loop's metric, so its rate is read as the run goes, as a rate set by hand
    (:mod:`gradcomp.optim.freeze_gate`). A wrapper that steps the scheduler it holds as ``.scheduler`` (the
    integrations' per-optimizer-step view, Accelerate's) is judged by that one."""
    inner = getattr(scheduler, "scheduler", None)
    if inner is not None and inner is not scheduler and plannable(inner) is None:
        return None
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (AttributeError, TypeError, ValueError):  # none given, or a step without a signature to read
        return scheduler
    required = [p for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return None if required else scheduler


def rewind(scheduler) -> bool:
    """Put ``scheduler`` (a copy, with a copy of its optimizer's param groups) back at the run's first step, as its
    constructor left it; whether it was moved. Exact for the schedulers whose rate is a function of the step
    (``LambdaLR``, which every HF ``get_scheduler`` type is, ``LinearLR``, ``OneCycleLR``, ...)."""
    base_lrs = getattr(scheduler, "base_lrs", None)
    if base_lrs is None or getattr(scheduler, "last_epoch", 0) == 0:
        return False
    for group, base_lr in zip(scheduler.optimizer.param_groups, base_lrs):
        group["lr"] = base_lr
    scheduler.last_epoch = -1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": nothing is trained here
        scheduler.step()
    return True


def _rates(scheduler, steps: int):
    """Group 0's learning rate of ``scheduler`` (mutated: stepped) now and after each of ``steps`` steps."""
    yield float(scheduler.optimizer.param_groups[0]["lr"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": nothing is trained here
        for _ in range(steps):
            scheduler.step()
            yield float(scheduler.optimizer.param_groups[0]["lr"])


def lr_peak_step(scheduler, total_steps: int) -> int:
    """The first step of the run at which ``scheduler``'s learning rate (group 0) peaks over ``total_steps``, found
    on a copy (the parameters shared, not copied; nothing of ``scheduler`` or its optimizer changes).

    A resumed run loads its scheduler's state before it registers: the copy is rewound to the run's first step
    (:func:`rewind`), so the plan is the one its checkpoint was saved under, where stepping the rewound copy back
    to the live step gives the live rate; else the peak is counted from the live step."""
    optimizer = scheduler.optimizer
    memo = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    memo.update({id(t): t for state in optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor)})
    probe, live = copy.deepcopy(scheduler, memo), float(optimizer.param_groups[0]["lr"])
    at = getattr(scheduler, "last_epoch", 0)
    if isinstance(at, int) and rewind(probe):
        check = copy.deepcopy(probe, memo)
        if not math.isclose(list(_rates(check, at))[-1], live, rel_tol=1e-9, abs_tol=0.0):
            probe = copy.deepcopy(scheduler, memo)  # not a function of the step: plan from here
    best_lr, best_step = None, 0
    for step, lr in enumerate(_rates(probe, total_steps - 1)):
        if best_lr is None or lr > best_lr * (1 + 1e-9):
            best_lr, best_step = lr, step
    return best_step
