"""Stepping aside: :class:`~gradcomp.optim.FrozenVarianceAdam` hands the parameters back to the user's Adam while
a policy sends every group dense (``Auto``, when a trial measured compressed steps no faster), its variance live
again and continuous with the frozen one, and freezes it again when compression comes back."""
from __future__ import annotations

import torch

__all__ = ["suspend", "resume"]


@torch.no_grad()
def suspend(stage) -> None:
    """Step ``stage`` aside: the user's Adam runs as it is, with a live variance, until :func:`resume`.

    A policy calls it between steps when every group went dense in the step just done (the residuals were
    flushed, ``exp_avg`` holds the averaged first moment). Mutates the optimizer's state: ``"frozen_denom"`` is
    dropped and ``exp_avg_sq`` rescaled so that Adam's next denominators, ``sqrt(exp_avg_sq / (1 - beta2^t))``,
    are the frozen ones (times the group's live level); forgets the stage's moments, waits, divisors, levels and
    refresh."""
    if stage.suspended:
        return
    named = {id(p) for p in stage.names.values()}
    for index, group in enumerate(stage.optimizer.param_groups):
        level = stage.level.ratio(index) if stage.level else 1.0
        for param in group["params"]:
            state = stage.optimizer.state.get(param, {})
            if id(param) not in named or state.pop("frozen_denom", None) is None or "exp_avg_sq" not in state:
                continue
            beta2 = group["betas"][1]
            state["exp_avg_sq"].mul_(level * (1 - beta2 ** stage._steps_done(param))
                                     / (1 - beta2 ** stage.variance_at()))
    if stage.level:
        stage.level.reset()
    stage.moments, stage.suspended, stage.refreshed_at = {}, True, None
    stage.catch_up.clear()
    stage.divisors.clear()
    stage._pending.clear()


def resume(stage) -> None:
    """Bring ``stage`` back after :func:`suspend`: the variance freezes again at this step's (the next compressed
    step computes the denominators from it), and each rank's first moment starts again from the optimizer's
    ``exp_avg``, the same on every rank."""
    if not stage.suspended:
        return
    stage.suspended = False
    stage.frozen_at = max([stage._frozen_at()] + [stage._steps_done(p) for p in stage.names.values()])
