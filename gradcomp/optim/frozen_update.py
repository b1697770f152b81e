"""The frozen-variance Adam update of one param group's parameters at once, with torch's multi-tensor ops.

:class:`~gradcomp.optim.FrozenVarianceAdam` runs it in the optimizer's step pre-hook on the parameters
whose variance is frozen. One call per operation for the whole group (``torch._foreach_*``, as torch's own
Adam) instead of one per parameter: on a GPU one kernel launch instead of one per parameter and operation.
On one CPU thread the passes over memory dominate, not the calls (the main job's transformer, 28 tensors,
437,760 elements: 0.81 ms a step either way). The arithmetic is the per-parameter one, operation for
operation, so the parameters are bitwise those of a step taken one parameter at a time
(``tests/test_frozen_update.py``). On the CPU the backend's ``frozen_step`` form (:data:`~gradcomp.backends.FORMS`)
does the same arithmetic in one pass, with the same bits, where it can promise them
(:mod:`gradcomp.backends.numba.frozen_step`).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from gradcomp.backends import form_kernel
from gradcomp.optim.spike_guard import multiplies, scaled

__all__ = ["frozen_update", "caught_up_update", "bounded_step"]


@torch.no_grad()
def frozen_update(params: List[torch.Tensor], exp_avgs: List[torch.Tensor], grads: List[torch.Tensor],
                  denoms: List[torch.Tensor], steps: Sequence[int], group: dict, decoupled: bool,
                  exchange: str, bounded: bool, factor: Optional[torch.Tensor] = None) -> None:
    """Step ``params`` by Adam with frozen denominators (each list one entry per parameter, alike shaped).

    Args:
        params: the parameters (mutated: ``p -= lr * m / (1 - b1^t) / d``, after ``p *= 1 - lr * wd`` when
            ``decoupled``).
        exp_avgs: the optimizer's first moments (mutated: ``exchange="momentum"``: the averaged first moment
            ``grads`` holds, copied; ``"gradient"``: its exponential average with ``grads`` (+ ``wd * p``
            when not ``decoupled``)).
        grads: what ``.grad`` holds (read only), stepped on times ``factor`` where it is given (0-d float32: the
            stage's spike guard and live level; :func:`~.spike_guard.scaled`).
        denoms: the frozen denominators ``d`` (read only).
        steps: each parameter's step number ``t`` after this step (its bias correction).
        group: the param group (``lr``, ``betas``, ``weight_decay``; read at this call).
        bounded: with ``exchange="gradient"``, scale a step whose root mean square in update units passes 1
            back to 1 (:func:`bounded_step`).
    """
    beta1, lr, wd = group["betas"][0], float(group["lr"]), group["weight_decay"]
    biases = [1 - beta1**t for t in steps]
    factor = factor if multiplies(factor) else None  # a CPU 1.0 multiplies nothing
    if params and not bounded and (decoupled or not wd) and isinstance(beta1, float):  # a tensor beta: torch's ops
        fused = form_kernel("elementwise", "frozen_step", params[0].device)
        if fused is not None and fused(params, exp_avgs, grads, denoms, factor, 1 - beta1, exchange == "momentum",
                                       1 - lr * wd if wd else None, [-lr / bias for bias in biases]):
            return
    grads = scaled(grads, factor)
    if exchange == "momentum":
        torch._foreach_copy_(exp_avgs, grads)
    else:
        if wd and not decoupled:
            grads = torch._foreach_add(grads, torch._foreach_mul(params, wd))
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    if wd and decoupled:
        torch._foreach_mul_(params, 1 - lr * wd)
    moments = exp_avgs
    if bounded and exchange == "gradient":
        moments = [m / bounded_step(m / d, bias) for m, d, bias in zip(exp_avgs, denoms, biases)]
    torch._foreach_addcdiv_(params, moments, denoms, [-lr / bias for bias in biases])


@torch.no_grad()
def caught_up_update(params: List[torch.Tensor], exp_avgs: List[torch.Tensor], grads: List[torch.Tensor],
                     denoms: List[torch.Tensor], steps: Sequence[int], group: dict, decoupled: bool, bounded: bool,
                     factor: Optional[torch.Tensor], shares: List[Optional[torch.Tensor]]) -> None:
    """:func:`frozen_update` with ``exchange="gradient"``, each late gradient caught up (:mod:`.catch_up`).

    ``shares[i]``: ``c`` of parameter ``i``'s coordinates (float32, its shape; ``None``: all on time, ``c = 1``).
    ``exp_avg`` takes ``c g`` in place of ``g``, and the parameter moves at once by ``(1 - c) g`` at the step's
    rate, ``-lr / (1 - b1^t) * factor * (1 - c) g / d``: Adam's exponential average is momentum damped by ``b1``,
    so what it would already have applied of a burst is ``(1 - b1) (1 - c) / (1 - b1)`` of it. The arguments are
    :func:`frozen_update`'s (``grads`` read only)."""
    late = [i for i, share in enumerate(shares) if share is not None]
    inputs = list(grads)
    for i in late:
        inputs[i] = (grads[i] * shares[i]).to(grads[i].dtype)
    frozen_update(params, exp_avgs, inputs, denoms, steps, group, decoupled, "gradient", bounded, factor)
    if late:
        beta1, lr = group["betas"][0], float(group["lr"])
        rest = [(grads[i] * shares[i].neg().add_(1.0)).to(grads[i].dtype) for i in late]
        torch._foreach_addcdiv_([params[i] for i in late], scaled(rest, factor),
                                [denoms[i] for i in late], [-lr / (1 - beta1 ** steps[i]) for i in late])


def bounded_step(update: torch.Tensor, bias: float = 1.0) -> torch.Tensor:
    """What divides ``update`` (a parameter's step in update units, ``update / bias`` if ``bias`` is given) so that
    its root mean square is at most 1: that root mean square where it passes 1, else exactly 1 (a 0-d tensor
    on ``update``'s device; no host sync, and a bitwise no-op where the bound holds)."""
    rms = update.float().norm() / (bias * math.sqrt(max(update.numel(), 1)))
    return rms.clamp(min=1.0)
