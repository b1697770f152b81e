"""What the frozen-variance recipe asks of the user's ``torch.optim.Adam``/``AdamW``, and the settings ranks compare.

:class:`~gradcomp.optim.FrozenVarianceAdam` checks the optimizer with :func:`check_optimizer` when it is
built, and reports :func:`optimizer_settings` in its ``settings()`` (the cross-rank check hashes them).
"""
from __future__ import annotations

import math
import warnings
from typing import List, Tuple

import torch

__all__ = ["MIN_STEADY_FREEZE", "VARIANCE_FLOOR", "EXCHANGES", "frozen_denominators", "optimizer_settings",
           "decoupled_weight_decay",
           "check_optimizer"]

#: Fewer steps than this before the freeze get a warning: the variance is then a handful of samples.
#: The recipe's choice between 3-bit and the ternary code under Adam reads it (``gradcomp.recipe.code``).
#: Set on charlm-small (AdamW, 200 steps: 2 dense steps ended +18.2% above dense, 8 -0.3%); at 200 steps it
#: also picks the better code on the shapes CNN and does no harm on proselm and the clipped GPT, but not on
#: the GPT without its clip, whose runs failed at 9 and at 17 dense steps when the variance froze inside the
#: hand-set warm-up: no count of steps is the rule (experiments/results/research-steady-freeze/); the freeze
#: now waits for such a warm-up to end (gradcomp.optim.freeze_gate), and both runs train.
MIN_STEADY_FREEZE = 10
#: The floor of a frozen ``sqrt(v_hat)``, as a fraction of its tensor's mean: a coordinate Adam has seen (almost)
#: no gradient for would otherwise divide by about ``eps`` and step by thousands of learning rates when error
#: feedback first sends it. Chosen, not tuned (every run of the study's five workloads has it); it binds only
#: where ``sqrt(v_hat)`` is under a tenth of its tensor's mean.
VARIANCE_FLOOR = 0.1
EXCHANGES = ("gradient", "momentum")


def _plain(value):
    """``value`` as plain, repr-stable Python (tensors become numbers or tuples)."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    return value


def optimizer_settings(optimizer) -> Tuple[Tuple[Tuple[str, object], ...], ...]:
    """Each param group's hyperparameters (the learning rate included: ranks compare them at the same
    step), sorted, as plain values: ranks whose optimizers differ would move their replicas apart."""
    return tuple(tuple(sorted((k, _plain(v)) for k, v in group.items() if k not in ("params", "step")))
                 for group in optimizer.param_groups)


def decoupled_weight_decay(optimizer, group) -> bool:
    """Whether ``group``'s weight decay is AdamW's (``p *= 1 - lr * wd``) rather than Adam's L2 term."""
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def check_optimizer(optimizer, freeze_step, exchange, variance_floor) -> None:
    if not isinstance(optimizer, torch.optim.Adam):
        raise TypeError(f"FrozenVarianceAdam takes a torch.optim.Adam or AdamW, got {type(optimizer).__name__}")
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ValueError(f"the optimizer's param group {index} has {flag}=True, which the frozen-variance "
                                 f"recipe does not support; create the optimizer with {flag}=False")
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
        raise ValueError(f"freeze_step must be an integer >= 1 (steps of plain Adam first), got {freeze_step!r}")
    if freeze_step < MIN_STEADY_FREEZE:
        warnings.warn(f"gradcomp: freezing Adam's variance after {freeze_step} steps fixes a second moment "
                      f"estimated from {freeze_step} gradients; freeze after the LR warm-up (the one-call recipe "
                      "asks 10% of the run under Adam, as far as the byte budget allows), or the frozen "
                      "denominators may be far off")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if not 0.0 <= variance_floor <= 1.0:
        raise ValueError(f"variance_floor must be in [0, 1], got {variance_floor}")


def frozen_denominators(variances: List[torch.Tensor], beta2: float, step: int, floor: float,
                        eps: float) -> List[torch.Tensor]:
    """Adam's denominators frozen at optimizer step ``step`` from ``variances`` (each ``exp_avg_sq``, read only):
    ``max(sqrt(v / (1 - b2^step)), floor * mean) + eps`` per tensor (new tensors, their shapes and dtypes), the
    floor a share of the tensor's own mean ``sqrt(v_hat)``. A list at once: a refresh renews every parameter's
    (torch's multi-tensor ops; each element's arithmetic as one tensor's ops, bit for bit)."""
    roots = torch._foreach_sqrt(variances)
    torch._foreach_div_(roots, math.sqrt(1 - beta2 ** step))
    torch._foreach_clamp_min_(roots, [float(root.mean()) * floor for root in roots])
    torch._foreach_add_(roots, eps)
    return roots
