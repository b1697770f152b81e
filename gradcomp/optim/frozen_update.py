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
                     factor: Optional[torch.Tensor], waits: List[Optional[torch.Tensor]], shares: torch.Tensor) -> None:
    """:func:`frozen_update` with ``exchange="gradient"``, each late gradient caught up (:mod:`.catch_up`).

    ``waits[i]``: the steps each coordinate of parameter ``i`` has waited (int16, its shape; ``None``: all on time),
    advanced by this step and zeroed where the average ``grads[i]`` is nonzero (mutated); ``shares``: ``c`` of every
    wait (:func:`~gradcomp.optim.catch_up.share_table` of ``b1``). ``exp_avg`` takes ``c g`` in place of ``g``, and
    the parameter moves at once by ``(1 - c) g`` at the step's rate, ``-lr / (1 - b1^t) * factor * (1 - c) g / d``:
    Adam's exponential average is momentum damped by ``b1``, so what it would already have applied of a burst is
    ``(1 - b1) (1 - c) / (1 - b1)`` of it. The other arguments are :func:`frozen_update`'s (``grads`` read only).
    On the CPU the backend's ``caught_up_step`` form does it in one pass with the same bits
    (:mod:`gradcomp.backends.numba.caught_up_step`)."""
    late = [i for i, wait in enumerate(waits) if wait is not None]
    on_time = [i for i, wait in enumerate(waits) if wait is None]
    if on_time:
        frozen_update(*([x[i] for i in on_time] for x in (params, exp_avgs, grads, denoms, steps)), group, decoupled,
                      "gradient", bounded, factor)
    if not late:
        return
    beta1, lr, wd = group["betas"][0], float(group["lr"]), group["weight_decay"]
    params, exp_avgs, grads, denoms, waits, steps = ([x[i] for i in late]
                                                     for x in (params, exp_avgs, grads, denoms, waits, steps))
    values = [-lr / (1 - beta1 ** t) for t in steps]
    factor = factor if multiplies(factor) else None
    if not bounded and (decoupled or not wd) and isinstance(beta1, float):  # a tensor beta: torch's ops
        fused = form_kernel("elementwise", "caught_up_step", params[0].device)
        if fused is not None and fused(params, exp_avgs, grads, denoms, waits, shares, factor, 1 - beta1,
                                       1 - lr * wd if wd else None, values):
            return
    torch._foreach_add_(waits, 1)  # this step's gradient is 1 step old
    c = [shares.index_select(0, wait.view(-1).int()).view(wait.shape) for wait in waits]
    inputs = [x.to(g.dtype) for x, g in zip(torch._foreach_mul(grads, c), grads)]
    frozen_update(params, exp_avgs, inputs, denoms, steps, group, decoupled, "gradient", bounded, factor)
    torch._foreach_neg_(c)
    torch._foreach_add_(c, 1.0)
    rest = [x.to(g.dtype) for x, g in zip(torch._foreach_mul(grads, c), grads)]
    torch._foreach_addcdiv_(params, scaled(rest, factor), denoms, values)
    for wait, grad in zip(waits, grads):  # a coordinate in the average waits no more
        wait.mul_(grad == 0)


def bounded_step(update: torch.Tensor, bias: float = 1.0) -> torch.Tensor:
    """What divides ``update`` (a parameter's step in update units, ``update / bias`` if ``bias`` is given) so that
    its root mean square is at most 1: that root mean square where it passes 1, else exactly 1 (a 0-d tensor
    on ``update``'s device; no host sync, and a bitwise no-op where the bound holds)."""
    rms = update.float().norm() / (bias * math.sqrt(max(update.numel(), 1)))
    return rms.clamp(min=1.0)
