"""The frozen variance refreshed from what the exchange delivers, each refresh renewing a fixed share of it.

Frozen for the whole run, Adam's variance keeps the level and the shape of the dense start's gradients, which a
long run leaves behind: on a regression whose gradients shrink by orders of magnitude (the held-out teacher MLP,
AdamW, 1,000 steps) both compressed recipes ended a third above dense (+32.6 % 2-bit, +32.4 % top-k), where
freezing at half the run instead of a tenth ended +2.6 % (``experiments/results/research-teacher-variance/``).
0/1 Adam's answer is to update the variance at spaced steps; here each refresh takes a sample ``s`` of what the
exchange already delivered (no extra bytes) as Adam would have taken it over the ``k`` steps since the last refresh,

    ``v = b2^k v + (1 - b2^k) s^2``,

and the denominators freeze again from ``v`` at this step ``t`` (its bias correction ``1 - b2^t`` is then exact).

**When** (:func:`renewed`): at the first step at which those ``k`` steps hold :data:`WEIGHT` of Adam's
bias-corrected variance, ``(1 - b2^k) / (1 - b2^t) >= WEIGHT``: every step just after a freeze at step 17, every
4 steps at step 70, every 52 steps late in a run at ``b2 = 0.999``, every step at ``b2 = 0.95``. One sample, noisy per
coordinate, then moves the denominators by that share and no more; spaced by ``b2`` alone instead (52 steps), the
first refresh after a freeze at step 17 renewed three quarters of the variance at once, and a 200-step top-k run
diverged.

**What** (:func:`_take`): the sample each exchange affords without its coding's bias. A sparsifier's average,
each coordinate's burst over the steps it gathered, ``s = g / (w + 1)``, zero where a coordinate was held back
(Adam's decay under a zero gradient: a held coordinate's variance keeps falling until its update-unit gradient wins
a place in the top-k, where a variance kept whole stayed frozen for good, the teacher +40 %). A quantizer's (or a
dense group's) first moment before the step, ``s = exp_avg``: its steps are larger than Adam's where a coordinate's
gradient is mostly noise, and train faster; the averaged gradient's square, nearer Adam's own sample (with or without
the code's rounding noise taken out), ended each AdamW 2-bit cell of the study about where dense does (the GPT +0.8 %,
shapes +9.1 %) where this one ends below it (-6.7 %, -90.3 %; ``experiments/results/research-quantizer-sample/``).
The recipe's Adam stage refreshes with :data:`WEIGHT`: on the teacher (seeds 0-2) 2-bit -15.7 % and top-k -11.3 %
against dense; a 200-step charlm-small run top-k -2.3 %, 2-bit -4.3 % (frozen for good -0.4 %, +0.1 %).
A refresh between the error feedback's bursts changes the update units its residuals are kept in; what they owe is
then delivered in the new units (rescaling them to keep the owed gradient moved the teacher's figures by under a
point).
"""
from __future__ import annotations

from typing import Dict

import torch

from gradcomp.optim.adam_settings import frozen_denominators

__all__ = ["WEIGHT", "renewed", "refresh_if_due"]

#: The share of Adam's bias-corrected variance one refresh renews (teacher MLP, AdamW, 1,000 steps, seeds 0-2: 2-bit
#: -15.7 % and top-k -11.3 % against dense, where the variance frozen for good ended +32 %).
WEIGHT = 0.05


def renewed(beta2: float, since: int, step: int) -> float:
    """The share of Adam's bias-corrected variance at optimizer step ``step`` (1-based) that its last ``since`` steps
    hold, ``(1 - b2^since) / (1 - b2^step)``: what a refresh of ``since`` steps' sample renews (1 outside
    ``0 < beta2 < 1``)."""
    if not 0.0 < beta2 < 1.0:
        return 1.0
    return (1.0 - beta2 ** since) / (1.0 - beta2 ** step)


@torch.no_grad()
def refresh_if_due(stage, done: Dict[int, int]) -> bool:
    """Refresh ``stage``'s (a ``FrozenVarianceAdam``) variance at this optimizer step if the steps since it froze
    or was last refreshed hold ``stage.refresh`` of a param group's variance (:func:`renewed`); return whether it did.

    ``done``: each parameter with a gradient, by ``id``, and its optimizer steps done (the stage's step reads them
    once). Called before the step advances the first moments and the waits. Mutates each frozen parameter's
    ``exp_avg_sq`` (:func:`_take`) and replaces its ``"frozen_denom"`` with the denominators frozen at this step
    (``frozen_denominators``, the stage's own formula, batched per param group), sets ``stage.refreshed_at``, and
    restarts the live level and the group divisors from the new denominators. Every rank does the same: the steps,
    the averaged gradients, the first moments and the waits are the same on each."""
    if stage.refresh is None or stage.suspended or not done:
        return False
    step = max(done.values())  # this step's gradient is Adam's (step + 1)-th
    if not stage.compresses_at(step):
        return False
    since = step + 1 - stage.variance_at()
    groups = stage.optimizer.param_groups
    if since < 1 or max(renewed(float(group["betas"][1]), since, step + 1) for group in groups) < stage.refresh:
        return False
    keys = {id(param): key for key, param in stage.names.items()}
    for group in groups:
        beta2 = float(group["betas"][1])
        taken = [(stage.optimizer.state[param], param) for param in group["params"]
                 if id(param) in keys and "exp_avg_sq" in stage.optimizer.state.get(param, {})]
        if not taken:
            continue
        _take(taken, [stage.catch_up.waits.get(keys[id(param)]) for _, param in taken], beta2 ** since)
        denoms = frozen_denominators([state["exp_avg_sq"] for state, _ in taken], beta2, step + 1,
                                     stage.variance_floor, group["eps"])
        for (state, _), denom in zip(taken, denoms):
            state["frozen_denom"] = denom
    stage.refreshed_at = step + 1
    if stage.level is not None:
        stage.level.reset()
    stage.divisors.clear()
    return True


def _take(taken, waits, kept: float) -> None:
    """``v = kept * v + (1 - kept) * s^2`` in each ``state["exp_avg_sq"]`` of ``taken`` (``(state, parameter)``
    pairs of one param group; float32, the parameter's shape; mutated), for ``kept = b2^k`` (``k`` the steps since
    the last refresh) and the sample ``s`` (torch's multi-tensor ops: one call for the group):

    * a sparsified parameter (its ``waits``: int16, its shape, not yet advanced by this step): the averaged
      gradient ``g`` (``.grad``) over the steps each coordinate gathered, ``s = g / (w + 1)``; zero where it was
      held back.
    * any other (a quantizer's, or sent dense): the first moment before this step, ``s = exp_avg``.
    * no gradient this step: ``s = 0``, Adam's decay under a zero gradient.
    """
    variances = [state["exp_avg_sq"] for state, _ in taken]
    torch._foreach_mul_(variances, kept)
    sampled, samples = [], []
    for (state, param), wait in zip(taken, waits):
        if param.grad is not None:
            sampled.append(state["exp_avg_sq"])
            samples.append(param.grad / (wait.to(param.grad.dtype) + 1) if wait is not None
                           else state.get("exp_avg", param.grad))
    if sampled:
        torch._foreach_addcmul_(sampled, samples, samples, value=1.0 - kept)
