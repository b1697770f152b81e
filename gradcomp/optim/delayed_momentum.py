"""SGD-momentum's stage under a sparsifier: each coordinate's late gradient applied as the momentum would have
applied it on time.

Top-k with error feedback holds a coordinate back until its accumulated value is among the largest, then
releases it: ``a`` steps of its gradient reach the optimizer at once, late. SGD's momentum, run after the
exchange on the average, would then spread that burst over its own memory (about ten steps at 0.9), on top of
the wait: a delayed gradient acts as momentum of its own (Mitliagkas et al., 2016), and at a constant rate the
two delays together broke a model the study never tuned for (``experiments/results/research-heldout-teacher/``).

This stage takes the burst ``r`` of a coordinate that waited ``a`` steps as ``a`` equal gradients ``r / a`` of
ages ``1..a`` and applies it as dense SGD-momentum would have applied them by now: the buffer takes what would be
left of them, the parameter moves by what would already have been applied. Per element, with ``c = S1(a) / a``
and ``S1(a) = (1 - beta^a) / (1 - beta)``::

    d = c * r (+ weight_decay * p)               r: the average, -grad when maximizing
    b <- beta * b + (1 - dampening) * d          torch's SGD step on d (Nesterov too)
    p <- p - lr * b
    p <- p - lr * (1 - dampening) * (1 - c) / (1 - beta) * r      the catch-up

A coordinate sent every step has ``a = 1``, ``c = 1``: torch's own step. One that waited long has ``c`` near 0:
its burst is applied at once, as plain SGD at ``lr / (1 - beta)``. ``a`` is the number of steps since the
coordinate was last nonzero in the average (1 when it was nonzero at the last step), which every rank reads alike
from the average it holds; a dense step resets it. Nothing is a constant of a model: measured (SGD-momentum,
top-k, the study's loops, ``experiments/results/research-shapes-sgd-seeds/``), it took the teacher MLP from
+1430 % above dense's held-out loss to +0.5 %, the shapes CNN from two seeds of six reaching dense's quality to
five, and the GPT and charlm-small from +3.0 % and +0.9 % to -1.5 % and -1.0 % (seed 0), where a delay given up
from the whole momentum helped the language models and broke the CNN.

``.grad`` is not changed: it holds the average gradient, as the loop left it (clipped, unscaled); the update runs
in a step pre-hook, like :class:`~gradcomp.optim.FrozenVarianceAdam`'s, which clears the ``.grad`` of the
parameters it stepped so that the optimizer's own step leaves them alone, and puts it back after the step.
Parameters whose group went dense this step (the dense start, a policy's dense choice, groups under ``min_numel``)
or went by a quantizer (every coordinate every step) take the optimizer's own step.
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Tuple

import torch

from gradcomp.optim.catch_up import Waits
from gradcomp.optim.step_hook import after_closure
from gradcomp.setup import unwrapped_names

__all__ = ["DelayedMomentumSGD"]


class DelayedMomentumSGD:
    """The engine's transform and a step pre-hook for the user's ``torch.optim.SGD`` with momentum.

    Args:
        optimizer: the user's SGD (momentum > 0 in at least one group); read at every step, never copied.
        named_parameters: ``(name, parameter)`` of the averaged parameters (the engine's keys).
        step_hook: register the pre-/post-step hooks (an integration whose ``step()`` averages first, the
            Horovod optimizer, passes ``False`` and calls :meth:`before_optimizer_step` itself).

    State: :attr:`catch_up`, the steps each coordinate of a compressed parameter has waited
    (:class:`~gradcomp.optim.catch_up.Waits`, the same on every rank).
    """

    #: The engine's ``suspended`` slot (a policy then keeps every group dense): never. The stage has no
    #: ``commit``: it keeps no state that waits on a step's verdict, so the engine skips a dense group's finite
    #: check for it.
    suspended = False

    def __init__(self, optimizer, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], step_hook: bool = True):
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"DelayedMomentumSGD needs torch.optim.SGD, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.names: Dict[Hashable, torch.nn.Parameter] = dict(unwrapped_names(named_parameters))
        self.catch_up = Waits()
        self._cleared: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
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
        self.catch_up.drop(keys)
        return grad

    def after_compress(self, keys, payload, compressor, numel: int) -> None:
        """Record ``keys`` as compressed this step where ``compressor`` holds coordinates back (a quantizer, which
        a policy may pick for a group, sends every coordinate every step: nothing waits)."""
        self.catch_up.record(keys, compressor)

    # -- the optimizer's step ------------------------------------------------------------------
    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """The catch-up step of every parameter compressed this step (before the optimizer's own step); mutates
        the parameter, its ``momentum_buffer`` and its wait, and clears its ``grad`` until
        :meth:`after_optimizer_step`. A parameter not compressed this step drops its wait (everything was sent).
        The parameters of a param group step together, through torch's multi-tensor ops."""
        compressed = {id(self.names[key]): key for key in self.catch_up.begin_step() if key in self.names}
        self._cleared = []
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if id(p) in compressed and p.grad is not None]
            if float(group["momentum"]) <= 0 or not params:
                continue
            self._step(params, group, [compressed[id(p)] for p in params])
            self._cleared += [(param, param.grad) for param in params]
            for param in params:
                param.grad = None

    def _step(self, params: List[torch.nn.Parameter], group: dict, keys: List[Hashable]) -> None:
        """One catch-up step of ``params`` (their ``grad`` read, not mutated; their waits, by ``keys``, advanced)."""
        beta, lr, damped = float(group["momentum"]), float(group["lr"]), 1.0 - float(group["dampening"])
        grads = [param.grad for param in params]
        r = torch._foreach_neg(grads) if group.get("maximize") else grads
        c = self.catch_up.shares(keys, params, beta)
        d = torch._foreach_mul(r, c)
        if group["weight_decay"]:
            torch._foreach_add_(d, params, alpha=group["weight_decay"])
        states = [self.optimizer.state[param] for param in params]
        kept = [(state["momentum_buffer"], d_i) for state, d_i in zip(states, d)
                if state.get("momentum_buffer") is not None]
        if kept:
            torch._foreach_mul_([buf for buf, _ in kept], beta)
            torch._foreach_add_([buf for buf, _ in kept], [d_i for _, d_i in kept], alpha=damped)
        for state, d_i, param in zip(states, d, params):
            if state.get("momentum_buffer") is None:  # torch starts the buffer at the first gradient, undamped
                state["momentum_buffer"] = d_i.to(param.dtype, copy=True)
        bufs = [state["momentum_buffer"] for state in states]
        step = torch._foreach_add(d, bufs, alpha=beta) if group["nesterov"] else bufs
        torch._foreach_add_(params, step, alpha=-lr)
        # the catch-up: (1 - c) / (1 - beta) of the burst, what dense momentum would already have applied
        torch._foreach_neg_(c)
        torch._foreach_add_(c, 1.0)
        torch._foreach_mul_(c, r)
        torch._foreach_add_(params, c, alpha=-lr * damped / (1.0 - beta))
        self.catch_up.settle(keys, r)

    def after_optimizer_step(self) -> None:
        """Put back the gradients :meth:`before_optimizer_step` cleared (each ``param.grad`` is mutated)."""
        for param, grad in self._cleared:
            if param.grad is None:  # a loop that set a gradient meanwhile keeps its own
                param.grad = grad
        self._cleared = []

    def reset(self) -> None:
        """Forget every wait (the residuals were reset: nothing is held back)."""
        self.catch_up.clear()

    # -- checkpoints: the waits (the buffers live in the optimizer's state) -----------------------
    def state_dict(self) -> dict:
        """``{"waits": {name: int16 tensor}}`` on CPU, the same on every rank."""
        return {"waits": self.catch_up.state_dict()}

    def prepare_load(self, state_dict: dict):
        """Check ``state_dict`` against this stage (raises ``ValueError``, changing nothing); returns the function
        that assigns it. A state saved before the stage kept waits (``delay_steps``, ``peak_lr``: the momentum it
        shortened then) loads with none: each held-back coordinate's next burst is taken as one step old."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"the checkpoint's stage state {state_dict!r} is not DelayedMomentumSGD's")
        if "waits" not in state_dict and "delay_steps" in state_dict:
            state_dict = {"waits": {}}
        if set(state_dict) != {"waits"}:
            raise ValueError(f"the checkpoint's stage state has keys {sorted(state_dict)}, DelayedMomentumSGD's "
                             "{'waits': {name: int16 tensor}}")
        return self.catch_up.prepare_load(state_dict["waits"], self.names, "DelayedMomentumSGD")

    def load_state_dict(self, state_dict: dict) -> None:
        self.prepare_load(state_dict)()

    def __repr__(self) -> str:
        return "DelayedMomentumSGD()"
