"""Variants of the variance refresh's sample for a quantizer's (not sparsified) parameters, replacing
``variance_refresh._take`` (gradcomp at b418314; imported where this directory is on PYTHONPATH, ``GC_SAMPLE`` set):

``moment``: the first moment before the step, ``s^2 = exp_avg^2`` (b418314's own rule).
``grad``: the step's averaged gradient as delivered, ``s^2 = g^2`` (``.grad``; includes the code's noise).
``coded``: ``s^2 = max(exp_avg^2, g^2 - c)``, ``c`` the 3-bit code's noise in the average: each rank's rounding
error ``e`` in ``[-h/2, h/2]`` (``h`` its chunk's step, ``max|acc| / 3`` over 128 entries in update units), the
delivered ``e_t - e_{t+1}`` of variance ``h^2 / 6``, over ``GC_SAMPLE_RANKS`` (2) ranks ``h^2 / (6 N)``; ``h``
estimated from the average itself (its chunk's largest ``|g / d|`` over 3) and times ``d^2`` in gradient units.
``GC_SAMPLE_LOG=1``: print the median over coordinates of ``s^2 / exp_avg^2`` at each refresh.
"""
import os
import sys

import torch

from gradcomp.optim import variance_refresh as vr

MODE = os.environ.get("GC_SAMPLE", "moment")
RANKS = int(os.environ.get("GC_SAMPLE_RANKS", "2"))
CHUNK = 128


def _code_noise(grad, denom):
    """The 3-bit code's noise variance in the average, per coordinate, gradient units (``grad``'s shape)."""
    units = (grad / denom).flatten()
    pad = (-units.numel()) % CHUNK
    chunks = torch.nn.functional.pad(units.abs(), (0, pad)).view(-1, CHUNK)
    step = chunks.amax(dim=1, keepdim=True) / 3
    noise = (step.square() / (6 * RANKS)).expand(-1, CHUNK).flatten()[:units.numel()].view_as(grad)
    return noise * denom.square()


def _sample_sq(state, grad):
    moment = state.get("exp_avg", grad)
    if MODE == "grad":
        return grad.square()
    if MODE == "coded" and "frozen_denom" in state:
        return torch.maximum(moment.square(), grad.square() - _code_noise(grad, state["frozen_denom"]))
    return moment.square()


def _take(taken, waits, kept):
    variances = [state["exp_avg_sq"] for state, _ in taken]
    torch._foreach_mul_(variances, kept)
    ratios = []
    for (state, param), wait in zip(taken, waits):
        grad = param.grad
        if grad is None:
            continue
        if wait is not None:
            sq = (grad / (wait.to(grad.dtype) + 1)).square()
        else:
            sq = _sample_sq(state, grad)
            moment = state.get("exp_avg", grad)
            ratios.append((sq / moment.square().clamp(min=1e-30)).flatten())
        state["exp_avg_sq"].add_(sq, alpha=1.0 - kept)
    if os.environ.get("GC_SAMPLE_LOG") and ratios:
        print(f"SAMPLE {MODE} s^2/exp_avg^2 median {torch.cat(ratios).median().item():.3f}", file=sys.stderr,
              flush=True)


if os.environ.get("GC_SAMPLE") is not None:
    vr._take = _take
