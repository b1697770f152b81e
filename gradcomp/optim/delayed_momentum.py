"""SGD-momentum's stage under a sparsifier: the momentum's memory shortened by the delay error feedback adds.

Top-k with error feedback holds a coordinate back until its accumulated value is among the largest, then
releases it: gradient mass reaches the optimizer late, and a late gradient acts as momentum of its own
(asynchronous SGD's "implicit momentum", Mitliagkas et al., 2016). On top of SGD's explicit momentum 0.9
that surplus left top-k 9 % above dense held-out loss on both transformers of the convergence study.
While a parameter's group is compressed, this stage gives its SGD update a momentum ``beta'`` whose own
mean delay ``beta' / (1 - beta')`` is the explicit one's, ``beta / (1 - beta)``, less :func:`delay_at`
(:data:`DELAY_STEPS` at top-k 1 %, less for a denser payload; a share of it below momentum 0.9, :func:`memory_share`),
at the same step size for a steady gradient (``lr / (1 - beta)``). Written in the
optimizer's own buffer (``b``, its units unchanged, so dense steps, checkpoints and a switch back go on as
they would)::

    k = (1 - beta') / (1 - beta)
    b <- beta' * b + k * (1 - dampening) * d        d = g (+ weight_decay * p); -g when maximizing
    p <- p - lr * b                                 Nesterov: p <- p - lr * (k * d + beta' * b)

which is torch's SGD with momentum ``beta'`` and learning rate ``k * lr`` on a buffer kept ``k`` times
larger. ``k`` is also how much harder than dense SGD-momentum the step answers a new gradient, which is what
bounds the delay given up at the peak rate (charlm-small runs near SGD's stability edge there). Once the
rate has fallen below the run's peak so far, the stage gives up more, as far as ``k * lr`` stays within
what it was at the peak (:func:`stable_delay`).

``.grad`` is not changed: it holds the average gradient, as the loop left it (clipped, unscaled); the update runs
in a step pre-hook, like :class:`~gradcomp.optim.FrozenVarianceAdam`'s, which clears the ``.grad`` of the
parameters it stepped so that the optimizer's own step leaves them alone, and puts it back after the step.
Parameters whose group went dense this step (the dense start, a policy's dense choice, groups under ``min_numel``)
take the optimizer's own step.
"""
from __future__ import annotations

import math
from typing import Dict, Hashable, Iterable, List, Tuple

import torch

from gradcomp.optim.step_hook import after_closure
from gradcomp.setup import unwrapped_names

__all__ = ["DelayedMomentumSGD", "DELAY_STEPS", "DELAY_DENSITY", "DELAY_MOMENTUM", "compressed_momentum",
           "delay_at", "held_back_density", "memory_share", "stable_delay"]

#: The mean delay, in steps, that error feedback adds at top-k density :data:`DELAY_DENSITY`, which the momentum
#: gives up (0.9 becomes 0.8: a mean delay of 4 steps in place of 9). Screened on the GPT and charlm-small under
#: SGD-momentum 0.9, top-k 1 % (``experiments/results/research-topk-momentum/``): 5 steps (0.8) took both from
#: +9 % to +1.6-2.4 % above dense's held-out loss (with the density scaling below, +3.7 % and +4.6 % in the
#: study); 8 steps (0.5) closed the GPT's gap but broke charlm-small, which runs near SGD's stability edge (a
#: shorter memory answers a gradient with a larger first step); 9 (0) no better on the GPT. Little's law, measured in
#: both runs (the residual's mass over the gradient's per step), gives the same 1-5 steps over the ramp. The same
#: constant shortens Adam's first moment under top-k (:class:`~gradcomp.optim.FrozenVarianceAdam`; screened on the
#: main job's cell, ``experiments/results/research-topk-adam/``, and validated on the study's five workloads).
DELAY_STEPS = 5.0
#: The density :data:`DELAY_STEPS` was measured at. A denser payload holds coordinates back for less: the delay
#: given up at density ``rho`` is ``DELAY_STEPS * log(1/rho) / log(1/DELAY_DENSITY)``, at most ``DELAY_STEPS``
#: (a coordinate waits about as long as it takes to rank among the top ``rho`` share). With the whole 5 steps
#: from the ramp's first density (1/8) on, the CNN of the study (shapes) diverged 16 steps after its dense start.
DELAY_DENSITY = 0.01
#: The momentum :data:`DELAY_STEPS` was screened at (a memory of 9 steps). A shorter memory gives up the same share
#: of itself (:func:`memory_share`), a longer one no more than the screened steps. At momentum 0.8 and twice the rate
#: (the same steady step) the whole 4.25 steps at 2 % leave none of its 4 steps: compressed steps are plain SGD
#: answering a new gradient 5x harder: the GPT ended +4.8 / +3.6 % above that loop's dense (seeds 0, 1), +3.8 / +2.6 %
#: giving up half its memory plus a step, +3.2 / +2.9 % none, +1.5 / +1.8 % the same share as at 0.9 (proselm +0.5
#: against +0.3 %; ``experiments/results/research-shapes-sgd-seeds/momentum08/``). The CNN of the study (shapes), at
#: its stability edge there, breaks one seed of three under either law and does best giving up nothing.
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


def stable_delay(delay: float, beta: float, rate_ratio: float) -> float:
    """The delay given up at a learning rate ``rate_ratio`` (>= 1) times below the run's peak so far: ``delay``
    at the peak and more below it, as far as the step's answer to a new gradient, ``k * lr`` with
    ``k = (1 + m) / (1 + m - D)``, ``m = beta / (1 - beta)``, stays within its value at the peak:
    ``D = 1 + m - (1 + m - delay) / rate_ratio``, at most ``m`` (plain SGD). Measured under SGD-momentum
    top-k 1 %, seed 0, against the fixed delay (the loops' cosine decay to a tenth of the peak): charlm-small
    +2.4 % above dense's held-out loss against +4.4 %, the GPT +3.2 % against +4.3 %, proselm +0.3 % against
    +0.8 %, digits-mlp and shapes within 0.1 accuracy points of dense (as before)
    (``experiments/results/research-topk-momentum/``)."""
    if delay <= 0 or beta <= 0 or rate_ratio <= 1:
        return max(0.0, delay)  # at the peak: the density's delay as it is (compressed_momentum caps it at m)
    m = beta / (1.0 - beta)
    return min(m, max(delay, 1.0 + m - (1.0 + m - delay) / rate_ratio))


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


class DelayedMomentumSGD:
    """The engine's transform and a step pre-hook for the user's ``torch.optim.SGD`` with momentum.

    Args:
        optimizer: the user's SGD (momentum > 0 in at least one group); read at every step, never copied.
        named_parameters: ``(name, parameter)`` of the averaged parameters (the engine's keys).
        delay_steps: :data:`DELAY_STEPS`.
        step_hook: register the pre-/post-step hooks (an integration whose ``step()`` averages first, the
            Horovod optimizer, passes ``False`` and calls :meth:`before_optimizer_step` itself).
    """

    #: The engine's ``suspended`` slot (a policy then keeps every group dense): never. The stage has no
    #: ``commit``: it keeps no state that waits on a step's verdict, so the engine skips a dense group's finite
    #: check for it.
    suspended = False

    def __init__(self, optimizer, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 delay_steps: float = DELAY_STEPS, step_hook: bool = True):
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"DelayedMomentumSGD needs torch.optim.SGD, got {type(optimizer).__name__}")
        if not float(delay_steps) >= 0:
            raise ValueError(f"delay_steps must be >= 0, got {delay_steps!r}")
        self.optimizer, self.delay_steps = optimizer, float(delay_steps)
        self.names: Dict[Hashable, torch.nn.Parameter] = dict(unwrapped_names(named_parameters))
        # The density of each name whose group a sparsifier compressed in this step's exchange (after_compress).
        self._compressed: Dict[Hashable, float] = {}
        self._cleared: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
        # The highest learning rate each param group has stepped at (every step, dense ones too), for stable_delay.
        self._peak_lr: List[float] = []
        if step_hook:
            optimizer.register_step_pre_hook(after_closure(self.before_optimizer_step))
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())

    def parameter_names(self):
        """The names this stage knows (the engine's keys)."""
        return set(self.names)

    # -- the engine's transform protocol: only which groups were compressed ------------------
    def before_compress(self, keys, numels, grad: torch.Tensor, compressor) -> torch.Tensor:
        """The gradient, unchanged (not mutated): the stage acts in the optimizer's step."""
        return grad

    def dense(self, keys, numels, grad: torch.Tensor) -> torch.Tensor:
        for key in keys:
            self._compressed.pop(key, None)
        return grad

    def after_compress(self, keys, payload, compressor, numel: int) -> None:
        """Record ``keys`` as compressed this step where ``compressor`` holds them back (a quantizer, which a
        policy may pick for a group, sends every coordinate every step: no delay to give up)."""
        density = held_back_density(compressor)
        for key in keys:
            self._compressed[key] = density

    # -- the optimizer's step ------------------------------------------------------------------
    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """The shortened-momentum update of every parameter compressed this step (before the optimizer's own
        step); mutates the parameter and its ``momentum_buffer`` and clears its ``grad`` until
        :meth:`after_optimizer_step`. Parameters of a param group held back alike step together, through
        torch's multi-tensor ops (as torch's own SGD does): one call per operation, not per parameter."""
        compressed = {id(self.names[key]): density for key, density in self._compressed.items() if key in self.names}
        self._compressed.clear()
        self._cleared = []
        delays = {density: delay_at(density, self.delay_steps) for density in set(compressed.values())}
        for index, group in enumerate(self.optimizer.param_groups):
            ratio, beta = self._rate_ratio(index, float(group["lr"])), float(group["momentum"])
            if beta <= 0:
                continue
            alike: Dict[float, List[torch.nn.Parameter]] = {}
            for param in group["params"]:
                delay = delays.get(compressed.get(id(param)), 0.0)
                if param.grad is not None and delay > 0:
                    alike.setdefault(delay, []).append(param)
            for delay, params in alike.items():
                fast = compressed_momentum(beta, stable_delay(delay * memory_share(beta), beta, ratio))
                self._step(params, group, fast, (1 - fast) / (1 - beta))
                self._cleared += [(param, param.grad) for param in params]
                for param in params:
                    param.grad = None

    def _rate_ratio(self, index: int, lr: float) -> float:
        """The peak learning rate param group ``index`` has stepped at, over ``lr`` (>= 1); records ``lr``."""
        if index == len(self._peak_lr):
            self._peak_lr.append(lr)
        self._peak_lr[index] = peak = max(self._peak_lr[index], lr)
        return peak / lr if lr > 0 else 1.0

    def _step(self, params: List[torch.nn.Parameter], group: dict, fast: float, k: float) -> None:
        """One shortened-momentum step of ``params`` (their ``grad`` read, not mutated)."""
        grads = [param.grad for param in params]
        d = torch._foreach_neg(grads) if group.get("maximize") else grads
        if group["weight_decay"]:
            d = torch._foreach_add(d, params, alpha=group["weight_decay"])
        states = [self.optimizer.state[param] for param in params]
        kept = [(state["momentum_buffer"], d_i) for state, d_i in zip(states, d)
                if state.get("momentum_buffer") is not None]
        if kept:
            torch._foreach_mul_([buf for buf, _ in kept], fast)
            torch._foreach_add_([buf for buf, _ in kept], [d_i for _, d_i in kept], alpha=k * (1 - group["dampening"]))
        for state, d_i in zip(states, d):
            if state.get("momentum_buffer") is None:  # torch starts the buffer at the first gradient, undamped
                state["momentum_buffer"] = d_i.mul(k)
        bufs = [state["momentum_buffer"] for state in states]
        step = torch._foreach_add(torch._foreach_mul(d, k), bufs, alpha=fast) if group["nesterov"] else bufs
        torch._foreach_add_(params, step, alpha=-float(group["lr"]))

    def after_optimizer_step(self) -> None:
        """Put back the gradients :meth:`before_optimizer_step` cleared (each ``param.grad`` is mutated)."""
        for param, grad in self._cleared:
            if param.grad is None:  # a loop that set a gradient meanwhile keeps its own
                param.grad = grad
        self._cleared = []

    # -- checkpoints: the stage's setting (its buffer lives in the optimizer's state) --------------
    def state_dict(self) -> dict:
        return {"delay_steps": self.delay_steps, "peak_lr": list(self._peak_lr)}

    def prepare_load(self, state_dict: dict):
        """Check ``state_dict`` against this stage (raises ``ValueError``, changing nothing); returns the
        assignment of the peak learning rates (the stage's buffers are the optimizer's, restored with its own
        state dict). A state without ``peak_lr`` (saved before the stage kept it) restarts the peaks at the
        resumed rates."""
        if not isinstance(state_dict, dict) or state_dict.get("delay_steps") != self.delay_steps:
            raise ValueError(f"the checkpoint's stage state {state_dict!r} is not this run's "
                             f"DelayedMomentumSGD(delay_steps={self.delay_steps!r})")
        peaks = state_dict.get("peak_lr", [])
        if not isinstance(peaks, list) or not all(isinstance(p, float) and p >= 0 for p in peaks):
            raise ValueError(f"the checkpoint's peak learning rates {peaks!r} are not a list of floats >= 0")

        def assign() -> None:
            self._peak_lr = list(peaks)

        return assign

    def load_state_dict(self, state_dict: dict) -> None:
        self.prepare_load(state_dict)()

    def __repr__(self) -> str:
        return f"DelayedMomentumSGD(delay_steps={self.delay_steps!r})"
