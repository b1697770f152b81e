"""The norms an Adam stage reads from a step's gradients, in one pass where the kernels can.

The spike guard follows ``rms(g / d)`` over the stage's parameters and the live level ``rms(g)`` over a param group's
(:mod:`.spike_guard`, :mod:`.live_level`). Both are sums of squared per-tensor norms, and torch's multi-tensor ops
take three passes for them and a new tensor as large as the gradients (the quotients): on charlm-small's 437,760
elements about 1.1 ms of a rank's CPU in a 2-bit frozen step, the stage's largest piece. The backend's
``quotient_norms`` form (:data:`~gradcomp.backends.FORMS`) reads each gradient and denominator once and gives the same
bits, so the guard and the level decide exactly as they do on torch's norms.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from gradcomp.backends import form_kernel

__all__ = ["step_norms"]


def step_norms(grads: List[torch.Tensor], denoms: List[torch.Tensor],
               plain: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The norms of ``grads[t] / denoms[t]`` and, where ``plain``, of ``grads[t]`` (else ``None``): float32 ``[k]``
    each, bitwise ``torch.stack(torch._foreach_norm(...))`` of ``torch._foreach_div([g.float() for g in grads],
    denoms)`` and of ``[g.float() for g in grads]``. ``grads`` (``k >= 1``) and ``denoms``: alike shaped, read only."""
    fused = form_kernel("elementwise", "quotient_norms", grads[0].device)
    norms = fused(grads, denoms) if fused is not None else None
    if norms is not None:
        return norms[0], norms[1] if plain else None
    grads = [g.float() for g in grads]
    quotients = torch.stack(torch._foreach_norm(torch._foreach_div(grads, denoms)))
    return quotients, torch.stack(torch._foreach_norm(grads)) if plain else None
