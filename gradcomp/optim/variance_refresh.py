"""The frozen variance refreshed from the averaged gradients, at steps spaced by the variance's own memory.

Frozen for the whole run, Adam's variance keeps the level and the shape of the dense start's gradients, which a
long run leaves behind: on a regression whose gradients shrink by orders of magnitude (the held-out teacher MLP,
AdamW, 1,000 steps) both compressed recipes ended a third above dense (+32.6 % 2-bit, +32.4 % top-k), where
freezing at half the run instead of a tenth ended +2.6 % (``experiments/results/research-teacher-variance/``).
0/1 Adam's answer is to update the variance at spaced steps; here each refresh takes the step's averaged gradient
``g`` (``.grad`` as the loop left it: the exchange delivered it, no extra bytes) as Adam would have taken that
gradient over the ``k`` steps since the last refresh,

    ``v = b2^k v + (1 - b2^k) g^2``     (``g = 0`` for a parameter with no gradient this step),

and the denominators freeze again from ``v`` at this step (its bias correction ``1 - b2^t`` is then exact). The
refreshes are :func:`spacing` steps apart: as many as renew :data:`WEIGHT` of the variance under ``b2`` (52 steps
at ``b2 = 0.999``), so that one step's sample, noisy per coordinate, moves the variance by that share and no more.
On the teacher every 52 steps: 2-bit -0.3 %, top-k -2.0 % against dense (seeds 0-2); the convergence study's
charlm-small, seed 0, 2,000 steps: top-k -2.1 % (frozen for good -1.5 %), 2-bit -0.5 % (-0.3 %). A refresh between
the error feedback's bursts changes the update units its residuals are kept in; what they owe is then delivered in
the new units (rescaling them to keep the owed gradient moved the teacher's figures by under a point).
An option of :class:`~gradcomp.optim.FrozenVarianceAdam` (``refresh=WEIGHT``), not yet the recipe's: the study's
other AdamW cells are to be run with it first.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

__all__ = ["WEIGHT", "spacing", "refresh_if_due"]

#: The share of the variance one refresh renews (teacher MLP, AdamW, 1,000 steps, seeds 0-2: refreshed every 52 steps
#: from the averaged gradient, 2-bit -0.3 % and top-k -2.0 % against dense, where the frozen variance ended +32 %).
WEIGHT = 0.05


def spacing(beta2: float, weight: float = WEIGHT) -> int:
    """Steps between refreshes under ``beta2``: the fewest over which the variance forgets ``weight`` of itself,
    ``ceil(ln(1 - weight) / ln(beta2))``, at least 1."""
    if not 0.0 < beta2 < 1.0:
        return 1
    return max(1, math.ceil(math.log(1.0 - weight) / math.log(beta2)))


@torch.no_grad()
def refresh_if_due(stage, done: Dict[int, int]) -> bool:
    """Refresh ``stage``'s (a ``FrozenVarianceAdam``) variance at this optimizer step if :func:`spacing` steps of
    every param group have passed since it froze or was last refreshed; return whether it did.

    ``done``: each parameter with a gradient, by ``id``, and its optimizer steps done (the stage's step reads them
    once). Mutates each frozen parameter's ``exp_avg_sq`` and drops its ``"frozen_denom"`` (the stage computes the
    new one at its next use, from :attr:`~FrozenVarianceAdam.refreshed_at`), sets ``stage.refreshed_at``, and restarts
    the live level and the group divisors from the new denominators. Every rank does the same: the steps and the
    averaged gradients are the same on each."""
    if stage.refresh is None or stage.suspended or not done:
        return False
    step = max(done.values())  # this step's gradient is Adam's (step + 1)-th
    if not stage.compresses_at(step):
        return False
    since = step + 1 - stage.variance_at()
    groups = stage.optimizer.param_groups
    if since < min(spacing(float(group["betas"][1]), stage.refresh) for group in groups):
        return False
    named = {id(p) for p in stage.names.values()}
    for group in groups:
        beta2 = float(group["betas"][1])
        kept = beta2 ** since
        for param in group["params"]:
            state = stage.optimizer.state.get(param, {})
            if id(param) not in named or "exp_avg_sq" not in state:
                continue
            variance = state["exp_avg_sq"].mul_(kept)
            if param.grad is not None:
                variance.addcmul_(param.grad, param.grad, value=1.0 - kept)
            state.pop("frozen_denom", None)
    stage.refreshed_at = step + 1
    if stage.level is not None:
        stage.level.reset()
    stage.divisors.clear()
    return True
