"""The recipe's optimizer stage: which one the user's optimizer gets, with its settings and its description.

:func:`gradcomp.recipe.plan` calls :func:`optimizer_stage` once the dense start is planned; the stages
themselves are :mod:`gradcomp.optim`'s.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["optimizer_stage"]


def optimizer_stage(optimizer, compressor, named, dense_steps: int, notes: list, step_hook: bool = True,
                    sharded: bool = False, latest_freeze: Optional[int] = None,
                    freeze_cost: Optional[Callable[[int], str]] = None):
    """``(transform, description)`` for ``optimizer`` (``sharded``: FSDP's, no SGD stage).

    Adam/AdamW: :class:`~gradcomp.optim.FrozenVarianceAdam` frozen at ``dense_steps``, or, with
    ``latest_freeze`` past it, later while the learning rate still rises (up to that step;
    ``freeze_cost(delay)`` words what a later freeze costs); under a sparsifier each late gradient caught up
    (:mod:`gradcomp.optim.catch_up`); the variance refreshed (:mod:`gradcomp.optim.variance_refresh`). SGD
    with momentum under a sparsifier: :class:`~gradcomp.optim.DelayedMomentumSGD`. Other optimizers: none, with
    a note in ``notes`` (appended)."""
    from gradcomp.optim import DelayedMomentumSGD, FrozenVarianceAdam
    from gradcomp.optim.variance_refresh import WEIGHT

    if isinstance(optimizer, torch.optim.Adam):
        # the gradient exchanged, a sparsifier's late gradients caught up in the step (FSDP refuses Adam's stage:
        # hooks/fsdp.py); the spike guard would scale back the bursts the catch-up owes
        caught_up = compressor.sparsifies
        latest = latest_freeze if latest_freeze is not None and latest_freeze > dense_steps else None
        stage = FrozenVarianceAdam(optimizer, named, freeze_step=dense_steps, step_hook=step_hook,
                                   latest_freeze=latest, freeze_cost=freeze_cost, spike_guard=not caught_up,
                                   refresh=WEIGHT)
        later = f", later while the learning rate rises, up to step {latest}" if latest is not None else ""
        level = ", each param group's step level live" if stage.level is not None else ""
        renewed = f", the variance refreshed at steps renewing {WEIGHT:.0%} of it"
        late = ", each coordinate's late gradient caught up as the first moment would have taken it on time"
        return stage, (f"frozen-variance {type(optimizer).__name__} (freeze at step {dense_steps}{later}, each rank's "
                       f"gradient sent in update units{late if caught_up else ''}{level}{renewed})")
    if isinstance(optimizer, torch.optim.SGD):
        momentum = any(g.get("momentum", 0) for g in optimizer.param_groups)
        if momentum and compressor.sparsifies and not sharded:
            stage = DelayedMomentumSGD(optimizer, named, step_hook=step_hook)
            return stage, ("error feedback into SGD (its momentum after the exchange, each coordinate's late "
                           "gradient caught up as the momentum would have applied it on time)")
        return None, f"error feedback into SGD{' (its momentum after the exchange)' if momentum else ''}"
    if optimizer is not None:
        notes.append(f"{type(optimizer).__name__} has no optimizer-aware stage: plain error feedback with "
                     f"{dense_steps} dense steps; SGD and Adam/AdamW have recipes")
    return None, "error feedback"
