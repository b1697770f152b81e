"""A guard on the frozen-variance step against jumps of what it steps on.

Adam bounds its own step where the gradient jumps: the jump enters its second moment at once
(``v += (1 - b2) g^2``), so one coordinate moves at most about ``lr / sqrt(1 - b2)``. A frozen variance
passes the jump through whole. Error feedback makes one at the freeze: the first compressed steps send
what the residuals gathered (the GPT loop without its clip, AdamW, 2-bit, seed 0: the averaged gradient's
root mean square in update units went from 0.5-1.3 over the dense start's last steps to 2.1 and 3.1 at
the steps after the freeze and 3.4-7.0 ten steps later; held-out loss 3.10 at step 39 where dense's was
2.86; the run ended 1.5746, 1.5533 with the guard; ``experiments/results/research-spike-guard/``).

:class:`SpikeGuard` follows ``r = rms(g / d)`` over the stage's parameters at every optimizer step (one
number, the same on every rank: ``g`` is the average, ``d`` the frozen denominators, before the freeze
Adam's own ``sqrt(v_hat) + eps``) with exponential averages of its mean and variance, and in the frozen
phase scales a step's ``g`` whose ``r`` passes ``mean + Z * sd`` back to that limit: the z-score test of
ZClip (Kumar et al., 2025, arXiv 2504.02507), with its defaults (``alpha`` 0.97, ``z`` 2.5), on Adam's
units instead of the gradient's norm. The user's ``.grad`` is left as it is (the stage scales its own copy).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from gradcomp.optim.step_norms import step_norms

__all__ = ["SpikeGuard", "SPIKE_ALPHA", "SPIKE_Z", "SPIKE_SKIP", "SUSPENDED_STRIDE", "guard_factor",
           "live_denominators", "multiplies", "scaled"]

#: The smoothing of the averages (ZClip's default).
SPIKE_ALPHA = 0.97
#: How many standard deviations above the mean a step's ``r`` may pass (ZClip's default).
SPIKE_Z = 2.5
#: Optimizer steps left out of the averages at the start: Adam's ``v_hat`` from one to three gradients
#: makes ``r`` meaningless (the GPT loop's second step: 301, against about 1 from the fourth on).
SPIKE_SKIP = 3
#: While a policy keeps the stage suspended (every group dense, Adam's variance live: nothing for the guard to
#: scale) it observes one optimizer step in this many, so that its averages stay current for the steps after a
#: resume (a resume comes at a policy's recheck, every 100 steps by default: three observations between two) at a
#: 32nd of the cost: reading every parameter's gradient over Adam's denominator took about 1.5 ms of charlm-small's
#: 34 ms dense step (437,760 elements, one thread; a harness under ``heavy``, a share, not a quiet timing), most of
#: what ``Auto`` added to a dense step; one step in 8 still cost 0.25 ms of thread CPU a step.
SUSPENDED_STRIDE = 32


class SpikeGuard:
    """The running mean and variance of ``r`` (0-d float32 tensors on the parameters' device, no host sync)
    and the scale of each frozen step.

    Args:
        alpha: the averages' smoothing, in (0, 1).
        z: the limit in standard deviations above the mean (> 0).
        skip: optimizer steps left out at the start (>= 0).
        warmup: observed steps before the guard may scale (>= 1); ZClip's 25 would miss the jump at the
            freeze of a short dense start, so it is 10, as the least dense start the recipe plans without
            a warning (:data:`~gradcomp.optim.adam_settings.MIN_STEADY_FREEZE`).
    """

    def __init__(self, alpha: float = SPIKE_ALPHA, z: float = SPIKE_Z, skip: int = SPIKE_SKIP, warmup: int = 10):
        if not 0.0 < alpha < 1.0 or not z > 0 or skip < 0 or warmup < 1:
            raise ValueError(f"SpikeGuard needs 0 < alpha < 1, z > 0, skip >= 0, warmup >= 1; got "
                             f"alpha={alpha}, z={z}, skip={skip}, warmup={warmup}")
        self.alpha, self.z, self.skip, self.warmup = float(alpha), float(z), int(skip), int(warmup)
        self.calls = 0  # optimizer steps seen, skipped ones included
        self.observed = 0  # steps in the averages
        self.mean = self.var = None

    @torch.no_grad()
    def scale(self, grads: List[torch.Tensor], denoms: List[torch.Tensor], frozen: bool,
              norms: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Observe this step's ``r = rms(grads / denoms)`` and return what the frozen step multiplies its
        gradients by: ``limit / r`` where ``frozen``, the guard warmed up and ``r`` past the limit, else 1.0
        exactly (a 0-d float32 tensor; multiplying by it is then a bitwise no-op). ``grads`` and ``denoms``: one
        tensor per parameter, alike shaped (read only); ``norms``: each quotient's norm where the caller has them
        (float32 ``[k]``, :func:`~.step_norms.step_norms`). The averages take ``min(r, limit)``."""
        device = grads[0].device if grads else torch.device("cpu")
        one = torch.ones((), dtype=torch.float32, device=device)
        self.calls += 1
        if not grads or self.calls <= self.skip:
            return one
        if norms is None:
            norms = step_norms(grads, denoms, plain=False)[0]
        squares = norms.square().sum()
        r = (squares / sum(g.numel() for g in grads)).sqrt()
        if self.mean is None:
            self.mean, self.var = r.clone(), torch.zeros_like(r)
        self.mean, self.var = self.mean.to(device), self.var.to(device)  # loaded on the CPU
        limit = self.mean + self.z * self.var.sqrt()
        factor = one
        if frozen and self.observed >= self.warmup:
            factor = torch.where(r > limit, limit / r, one)
            r = torch.minimum(r, limit)
        self.var = self.alpha * self.var + (1 - self.alpha) * (r - self.mean).pow(2)
        self.mean = self.alpha * self.mean + (1 - self.alpha) * r
        self.observed += 1
        return factor

    def state_dict(self) -> dict:
        """The counts and averages (plain floats): the same on every rank."""
        mean = None if self.mean is None else float(self.mean)
        var = None if self.var is None else float(self.var)
        return {"calls": self.calls, "observed": self.observed, "mean": mean, "var": var}

    def prepare_load(self, state: dict):
        """Validate :meth:`state_dict`'s output; return the function that assigns it. Raises ``ValueError``."""
        if not isinstance(state, dict) or set(state) != {"calls", "observed", "mean", "var"}:
            raise ValueError(f"the checkpoint's spike guard is not a SpikeGuard.state_dict(): {state!r}")
        counts = (state["calls"], state["observed"])
        stats = (state["mean"], state["var"])
        if any(type(c) is not int or c < 0 for c in counts) or (stats[0] is None) != (stats[1] is None) or any(
                s is not None and not (isinstance(s, float) and math.isfinite(s) and s >= 0) for s in stats):
            raise ValueError(f"the checkpoint's spike guard has counts {counts} and averages {stats}; expected "
                             "integers >= 0 and two finite floats >= 0 or two None")

        def assign() -> None:
            self.calls, self.observed = counts
            self.mean = None if stats[0] is None else torch.tensor(stats[0], dtype=torch.float32)
            self.var = None if stats[1] is None else torch.tensor(stats[1], dtype=torch.float32)

        return assign

    def __repr__(self) -> str:
        return f"SpikeGuard(alpha={self.alpha}, z={self.z}, skip={self.skip}, warmup={self.warmup})"


def live_denominators(variances: List[torch.Tensor], bias: float, eps: float) -> List[torch.Tensor]:
    """Adam's own denominators ``sqrt(v / bias) + eps`` of ``variances`` (``exp_avg_sq`` of parameters at one step
    count, read only; ``bias`` is ``1 - beta2^t``): new tensors, bitwise ``(v / bias).sqrt_().add_(eps)`` of each,
    in three multi-tensor ops rather than three per parameter."""
    denoms = torch._foreach_div(variances, bias)
    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps)
    return denoms


def multiplies(factor: Optional[torch.Tensor]) -> bool:
    """Whether a step multiplies its gradients by ``factor``: not where it is ``None`` or a CPU 1.0 (on the host that
    test is free and the copy is not; on a device the product runs: no host sync)."""
    return factor is not None and not (factor.device.type == "cpu" and float(factor) == 1.0)


def scaled(grads: List[torch.Tensor], factor: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """``grads`` times ``factor`` (new tensors; ``grads`` are not mutated) where it :func:`multiplies`, else
    ``grads`` themselves."""
    return torch._foreach_mul(grads, factor) if multiplies(factor) else grads


def guard_factor(stage, done: Dict[int, int]):
    """The factor of ``stage``'s (a ``FrozenVarianceAdam``) frozen updates this step (its :class:`SpikeGuard`;
    ``None``: none) from each gradient over its frozen or Adam's live denominator (``done``: the steps of each
    parameter with a gradient, by id); suspended, on one step in :data:`SUSPENDED_STRIDE`. With it the gradients'
    own norms from the same pass where a frozen step's live level reads them, ``(position of each parameter by id,
    float32 [k])``, else ``None``. Reads the stage and its optimizer; mutates the guard's averages."""
    first = next(iter(stage.names.values()), None)
    if stage.guard is None or stage.suspended and first is not None and stage._steps_done(first) % SUSPENDED_STRIDE:
        return None, None
    grads, denoms, live, frozen, at = [], [], {}, False, {}  # live: (bias correction, eps) -> where Adam's own go
    for group in stage.optimizer.param_groups:
        for param in group["params"]:
            steps = done.get(id(param), 0)
            if not steps:
                continue
            at[id(param)] = len(grads)
            grads.append(param.grad)
            if not stage.suspended and stage.compresses_at(steps):
                frozen = True
                denoms.append(stage._denom(param, group))
            else:
                live.setdefault((1 - group["betas"][1] ** steps, group["eps"]), []).append(len(denoms))
                denoms.append(stage.optimizer.state[param]["exp_avg_sq"])
    for (bias, eps), where in live.items():
        for place, denom in zip(where, live_denominators([denoms[place] for place in where], bias, eps)):
            denoms[place] = denom
    quotients, plain = step_norms(grads, denoms, stage.level is not None and frozen) if grads else (None, None)
    return stage.guard.scale(grads, denoms, frozen, quotients), None if plain is None else (at, plain)
