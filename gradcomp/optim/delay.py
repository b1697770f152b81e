"""The delay error feedback adds at a sparsifier's density, and the shorter memory that gives it up: the law of
:class:`~gradcomp.optim.FrozenVarianceAdam`'s first moment under top-k.

A top-k coordinate waits in the residual until its accumulated value ranks among the largest, so gradient mass
reaches the step late, and a late gradient acts as momentum of its own (asynchronous SGD's "implicit momentum",
Mitliagkas et al., 2016). Adam's stage forms each rank's first moment before the exchange; it gives up that
delay from the moment's memory, ``b1' / (1 - b1') = b1 / (1 - b1) - delay``, the steady state unchanged.

The constants were screened under SGD-momentum 0.9 (the momentum after the exchange, shortened alike), where a
per-coordinate catch-up has since replaced them (:mod:`gradcomp.optim.delayed_momentum`); under Adam they were
screened on the main job's cell and validated on the study's five workloads (``experiments/results/
research-topk-adam/``).
"""
from __future__ import annotations

import math

__all__ = ["DELAY_STEPS", "DELAY_DENSITY", "DELAY_MOMENTUM", "compressed_momentum", "delay_at", "held_back_density",
           "memory_share"]

#: The mean delay, in steps, that error feedback adds at top-k density :data:`DELAY_DENSITY`, which the memory
#: gives up (0.9 becomes 0.8: a mean delay of 4 steps in place of 9). Screened on the GPT and charlm-small under
#: SGD-momentum 0.9, top-k 1 % (``experiments/results/research-topk-momentum/``): 5 steps took both from +9 % to
#: +1.6-2.4 % above dense's held-out loss; 8 closed the GPT's gap but broke charlm-small; 9 no better on the GPT.
#: Under Adam (``research-topk-adam/``, the main job's cell): +3.1 % to +0.4 %.
DELAY_STEPS = 5.0
#: The density :data:`DELAY_STEPS` was measured at. A denser payload holds coordinates back for less: the delay
#: given up at density ``rho`` is ``DELAY_STEPS * log(1/rho) / log(1/DELAY_DENSITY)``, at most ``DELAY_STEPS``
#: (a coordinate waits about as long as it takes to rank among the top ``rho`` share).
DELAY_DENSITY = 0.01
#: The momentum :data:`DELAY_STEPS` was screened at (a memory of 9 steps). A shorter memory gives up the same share
#: of itself (:func:`memory_share`), a longer one no more than the screened steps (measured under SGD-momentum 0.8,
#: ``experiments/results/research-shapes-sgd-seeds/momentum08/``).
DELAY_MOMENTUM = 0.9


def delay_at(density: float, delay_steps: float = DELAY_STEPS) -> float:
    """The delay, in steps, given up on a step compressed at ``density`` (see :data:`DELAY_DENSITY`)."""
    if not 0 < density < 1:
        return 0.0
    return delay_steps * min(1.0, math.log(1 / density) / math.log(1 / DELAY_DENSITY))


def memory_share(beta: float) -> float:
    """The share of :func:`delay_at`'s steps momentum ``beta`` gives up: ``min(1, m / m0)``, ``m = beta / (1 - beta)``
    and ``m0`` :data:`DELAY_MOMENTUM`'s (1 at 0.9 and above, 4/9 at 0.8, 0 without momentum)."""
    if not 0 < beta < 1:
        return 0.0
    return min(1.0, (beta / (1.0 - beta)) / (DELAY_MOMENTUM / (1.0 - DELAY_MOMENTUM)))


def held_back_density(compressor) -> float:
    """The density at which a group compressed by ``compressor`` is held back: a sparsifier's ``density`` (a
    per-parameter payload's, its base's); 1 (nothing held back) for a quantizer, which sends every coordinate
    every step, and for ``None`` (a dense step).

    Every parameter of the group gives up the delay, those a per-parameter payload sends whole (under
    ``min_numel``) too: their update joins the delayed ones of the same step. Measured with those keeping
    the user's momentum instead (AdamW, top-k 1 %, 2000 steps): charlm-small +0.8 / +1.9 / +2.0 % above dense
    (seeds 0-2) against +0.7 / +1.6 / +1.4 %, the GPT -1.6 % against -2.0 %, proselm unchanged."""
    if compressor is None or not compressor.sparsifies:
        return 1.0
    return getattr(compressor.unwrapped(), "density", 1.0)


def compressed_momentum(beta: float, delay_steps: float = DELAY_STEPS) -> float:
    """``beta'`` with ``beta' / (1 - beta') = max(0, beta / (1 - beta) - delay_steps)`` (``0 <= beta < 1``);
    ``beta`` itself, bit for bit, when nothing is given up."""
    if delay_steps <= 0:
        return beta
    left = max(0.0, beta / (1.0 - beta) - delay_steps)
    return left / (1.0 + left)
