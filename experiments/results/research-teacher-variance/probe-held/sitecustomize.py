"""Variants of the variance refresh, replacing ``refresh_if_due`` (gradcomp at 0f558ec, whose ``spacing`` it uses;
imported where this directory is on PYTHONPATH, with ``GC_DIAG`` set to a comma-separated list):

``log``: print the quantiles of the denominators' change at each refresh (new / old ``sqrt(v_hat)``).
``moment``: every parameter's sample is its first moment (a sparsifier's too).
``unbiased``: a released coordinate's sample ``g^2 / (w + 1)`` (in place of ``(g / (w + 1))^2``).
``zero``: a coordinate a sparsifier held back decays as Adam's under a zero gradient (``v = b2^k v``).
``fixheld``: a held coordinate keeps its bias-corrected variance (0f558ec's own rule).
(neither): a held coordinate keeps its raw ``v`` (the first form, a868c85's).
``capped``: the sample's share of the bias-corrected variance is ``GC_DIAG_W`` whatever the steps since.
``adaptive``: a refresh when the steps since hold ``GC_DIAG_W`` (default 0.05) of Adam's bias-corrected variance,
``(1 - b2^k) / (1 - b2^t)`` (df259be's rule), in place of every ``spacing(b2)`` steps.
"""
import os
import sys

import torch

from gradcomp.optim import frozen_adam
from gradcomp.optim import variance_refresh as vr

MODE = set(os.environ.get("GC_DIAG", "").split(","))
W = float(os.environ.get("GC_DIAG_W", vr.WEIGHT))


def _due(stage, groups, since, step):
    if "adaptive" in MODE:  # refresh when Adam's bias-corrected share of k steps reaches W
        b2 = float(groups[0]["betas"][1])
        return (1 - b2 ** since) / (1 - b2 ** (step + 1)) >= W
    return since >= min(vr.spacing(float(g["betas"][1]), stage.refresh) for g in groups)


@torch.no_grad()
def refresh_if_due(stage, done):
    if stage.refresh is None or stage.suspended or not done:
        return False
    step = max(done.values())
    if not stage.compresses_at(step):
        return False
    t_old = stage.variance_at()
    since = step + 1 - t_old
    groups = stage.optimizer.param_groups
    if not _due(stage, groups, since, step):
        return False
    keys = {id(p): k for k, p in stage.names.items()}
    ratios = []
    for group in groups:
        b2 = float(group["betas"][1])
        kept = b2 ** since
        for param in group["params"]:
            state = stage.optimizer.state.get(param, {})
            if id(param) not in keys or "exp_avg_sq" not in state:
                continue
            v = state["exp_avg_sq"]
            old_hat = v / (1 - b2 ** t_old)
            waits = stage.catch_up.waits.get(keys[id(param)])
            grad = param.grad
            if "moment" in MODE:
                waits = None
            if grad is None:
                s2 = None
            elif waits is not None:
                div = (waits.to(grad.dtype) + 1)
                s2 = (grad / div).square() if "unbiased" not in MODE else grad.square() / div
            else:
                m = state.get("exp_avg", grad)
                s2 = m * m
            mask = (grad != 0) if (waits is not None and grad is not None) else None
            if "capped" in MODE:
                new_hat = old_hat * (1 - W) + (W * s2 if s2 is not None else 0)
                new = new_hat * (1 - b2 ** (step + 1))
            else:
                new = v * kept + ((1 - kept) * s2 if s2 is not None else 0)
            if mask is not None:
                if "zero" in MODE:
                    new = torch.where(mask, new, v * kept)
                elif "fixheld" in MODE:
                    new = torch.where(mask, new, v * (1 - b2 ** (step + 1)) / (1 - b2 ** t_old))
                else:
                    new = torch.where(mask, new, v)
            new_hat = new / (1 - b2 ** (step + 1))
            ratios.append((new_hat.sqrt() / old_hat.sqrt().clamp(min=1e-30)).flatten())
            v.copy_(new)
            state.pop("frozen_denom", None)
    stage.refreshed_at = step + 1
    if stage.level is not None:
        stage.level.reset()
    stage.divisors.clear()
    if "log" in MODE and ratios:
        _log(ratios, step, since)
    return True


def _log(ratios, step, since):
    q = torch.quantile(torch.cat(ratios)[:100000].float(), torch.tensor([0.01, 0.1, 0.5, 0.9])).tolist()
    print(f"DIAG refresh at {step + 1} since {since}: sqrt(v_hat) new/old q01,q10,q50,q90 "
          + " ".join(f"{x:.3f}" for x in q), file=sys.stderr, flush=True)


if os.environ.get("GC_DIAG") is not None:
    vr.refresh_if_due = refresh_if_due
    frozen_adam.refresh_if_due = refresh_if_due
