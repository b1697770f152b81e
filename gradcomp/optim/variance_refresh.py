"""The frozen variance refreshed from what the exchange delivers, at steps spaced by the variance's own memory.

Frozen for the whole run, Adam's variance keeps the level and the shape of the dense start's gradients, which a
long run leaves behind: on a regression whose gradients shrink by orders of magnitude (the held-out teacher MLP,
AdamW, 1,000 steps) both compressed recipes ended a third above dense (+32.6 % 2-bit, +32.4 % top-k), where
freezing at half the run instead of a tenth ended +2.6 % (``experiments/results/research-teacher-variance/``).
0/1 Adam's answer is to update the variance at spaced steps; here each refresh takes a sample ``s`` from what the
exchange already delivered (no extra bytes) as Adam would have taken it over the ``k`` steps since the last refresh,

    ``v = b2^k v + (1 - b2^k) s^2``,

and the denominators freeze again from ``v`` at this step (its bias correction ``1 - b2^t`` is then exact). The
sample is what each exchange affords without bias toward zero or toward its own coding (:func:`_take`): under a
sparsifier only the coordinates released this step, their burst over its wait; under a quantizer the first moment.
(The step's averaged gradient squared, the first form: a top-k average is zero where coordinates wait, a 2-bit one
overstates small coordinates; it cost the GPT and the 2-bit classifiers what it gave the teacher.)
The refreshes are :func:`spacing` steps apart: as many as renew :data:`WEIGHT` of the variance under ``b2`` (52 steps
at ``b2 = 0.999``), so that one step's sample, noisy per coordinate, moves the variance by that share and no more.
On the teacher (seeds 0-2): top-k -3.7 %, 2-bit -14.5 % against dense. A refresh between the error feedback's
bursts changes the update units its residuals are kept in; what they owe is then delivered in the new units
(rescaling them to keep the owed gradient moved the teacher's figures by under a point).
The recipe's Adam stage refreshes with :data:`WEIGHT`.
"""
from __future__ import annotations

import math
from typing import Dict

import torch

__all__ = ["WEIGHT", "spacing", "refresh_if_due"]

#: The share of the variance one refresh renews (teacher MLP, AdamW, 1,000 steps, seeds 0-2: refreshed every 52 steps,
#: 2-bit -14.5 % and top-k -3.7 % against dense, where the frozen variance ended +32 %).
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
    once). Called before the step advances the first moments and the waits. Mutates each frozen parameter's
    ``exp_avg_sq`` (:func:`_take`) and drops its ``"frozen_denom"`` (the stage computes the new one at its next use,
    from :attr:`~FrozenVarianceAdam.refreshed_at`), sets ``stage.refreshed_at``, and restarts the live level and the
    group divisors from the new denominators. Every rank does the same: the steps, the averaged gradients, the
    first moments and the waits are the same on each."""
    if stage.refresh is None or stage.suspended or not done:
        return False
    step = max(done.values())  # this step's gradient is Adam's (step + 1)-th
    if not stage.compresses_at(step):
        return False
    since = step + 1 - stage.variance_at()
    groups = stage.optimizer.param_groups
    if since < min(spacing(float(group["betas"][1]), stage.refresh) for group in groups):
        return False
    keys = {id(param): key for key, param in stage.names.items()}
    for group in groups:
        beta2 = float(group["betas"][1])
        # a coordinate without a sample keeps its bias-corrected variance: v scales with 1 - b2^t
        kept, held = beta2 ** since, (1 - beta2 ** (step + 1)) / (1 - beta2 ** (step + 1 - since))
        for param in group["params"]:
            state = stage.optimizer.state.get(param, {})
            if id(param) in keys and "exp_avg_sq" in state:
                _take(state, param.grad, stage.catch_up.waits.get(keys[id(param)]), kept, held)
                state.pop("frozen_denom", None)
    stage.refreshed_at = step + 1
    if stage.level is not None:
        stage.level.reset()
    stage.divisors.clear()
    return True


def _take(state: dict, grad, waits, kept: float, held: float) -> None:
    """``v = kept * v + (1 - kept) * s^2`` in ``state["exp_avg_sq"]`` (float32, the parameter's shape; mutated) for the
    sample ``s`` the exchange affords (``kept = b2^k``, ``k`` the steps since the last refresh):

    * a sparsified parameter (``waits``: int16, its shape, not yet advanced by this step): only the coordinates
      released this step (nonzero in ``grad``, the averaged gradient) take a sample, their burst over the steps it
      gathered, ``s = g / (w + 1)``; the others keep their bias-corrected variance, ``v = held * v`` (``held =
      (1 - b2^t) / (1 - b2^t_last)``): they bring no fresh gradient to square, and the raw ``v`` kept as it was would
      read smaller under the new step's bias correction (half the denominators at the first refresh of a 200-step
      run, whose top-k then diverged). The whole average's square, zero where coordinates wait, shrank a sparse
      GPT's variance until its steps blew up.
    * any other (a quantizer's, or sent dense): the first moment before this step, ``s = exp_avg``. A 2-bit
      average's square overstates a small coordinate's (about ``level * |g|``): from it the classifiers and the GPT
      lost what the refresh gave; from the first moment the teacher ended -14.5 % against dense.
    * no gradient this step: the variance decays, as Adam's would under a zero gradient.

    ``experiments/results/research-teacher-variance/``."""
    variance = state["exp_avg_sq"]
    if grad is None:
        variance.mul_(kept)
    elif waits is not None:
        sample = (grad / (waits.to(grad.dtype) + 1)).square()
        variance.copy_(torch.where(grad != 0, variance * kept + (1 - kept) * sample, variance * held))
    else:
        moment = state.get("exp_avg", grad)
        variance.mul_(kept).addcmul_(moment, moment, value=1.0 - kept)
