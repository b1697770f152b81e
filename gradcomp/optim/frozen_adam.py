"""The compressed-Adam stage for a user's own ``torch.optim.Adam``/``AdamW`` (1-bit Adam's recipe).

:class:`~gradcomp.optim.CompressedAdamW` is an optimizer of its own; a training script that
already builds ``torch.optim.AdamW`` (and an LR scheduler and a checkpoint around it) should not
have to change it. :class:`FrozenVarianceAdam` gives that optimizer the same recipe in place:

1. **Warm-up** (the optimizer's first ``freeze_step`` steps): untouched, the user's own Adam, on
   densely averaged gradients.
2. **Freeze**: at the first step after the warm-up, each parameter's denominator
   ``max(sqrt(v_hat), floor * mean sqrt(v_hat)) + eps`` is computed once from the optimizer's own
   ``exp_avg_sq`` and kept in its state (``"frozen_denom"``, saved by ``optimizer.state_dict()``).
   The floor keeps never-updated coordinates from turning the first momentum into a huge step.
3. **Compressed phase**: each rank sends its local momentum ``m' = b1 * m + (1 - b1) * g`` (Adam's
   L2 term ``wd * p`` added to ``g`` first) -- in ``units="update"`` divided by the frozen
   denominator, so top-k picks the largest *updates* and a 2-bit scale fits every coordinate -- and
   the engine averages it with error feedback. The average ``a``, identical on every rank, reaches
   the optimizer as the gradient; a step pre-hook applies ``p -= lr * a / (1 - b1^t)`` (``/ denom``
   in ``units="momentum"``; AdamW: after ``p *= 1 - lr * wd``), advances the optimizer's step
   count and clears ``p.grad`` so that the optimizer's own step leaves the parameter alone.

   What becomes the optimizer's ``exp_avg`` is the ``momentum`` setting. ``"local"`` (default):
   each rank keeps its own ``m'`` (written when the engine commits the step), so a gradient keeps
   driving ``b1 / (1 - b1)`` later steps whatever the compressor dropped, and over the run the
   averages sent add up to dense Adam's updates (the local momenta average to the global one).
   ``"averaged"``: ``exp_avg`` becomes the decoded average ``a`` (1-bit Adam's arrangement, right
   for a dense quantizer); a sparse ``a`` then restarts the momentum from zero at every coordinate
   it did not send. Measured on the GRU ``proselm`` (1 process, AdamW frozen at step 30, top-k with
   error feedback, 600 steps, held-out loss vs dense 1.834): density 1%: averaged 2.184, local
   1.981; density 5%: averaged 1.973, local 1.872. With ``"local"`` the ``exp_avg`` of each rank
   differs: save the optimizer's state on every rank (as the engine's residuals) for a bitwise
   resume; loading rank 0's everywhere keeps the replicas equal but changes the momentum.

LR schedulers, ``optimizer.state_dict()``/``load_state_dict()`` and param groups keep working:
the stage reads everything from the optimizer at each call and keeps no copy. ``amsgrad`` and
``maximize`` are refused (they change what the frozen step must be).
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, Hashable, Iterable, List, Tuple, Union

import torch

from gradcomp.optim.dgc import optimizer_settings
from gradcomp.optim.names import unwrapped

__all__ = ["FrozenVarianceAdam"]

#: Fewer steps than this before the freeze get a warning: the variance is then a handful of samples.
MIN_STEADY_FREEZE = 10

UNITS = ("momentum", "update")
MOMENTA = ("local", "averaged")


def _decoupled(optimizer, group) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


class FrozenVarianceAdam:
    """The engine's ``transform`` that puts a ``torch.optim.Adam``/``AdamW`` on 1-bit Adam's recipe.

    Args:
        optimizer: the user's ``torch.optim.Adam`` or ``AdamW`` (mutated: a step pre-hook is
            registered; after the freeze its state gains ``"frozen_denom"`` per parameter).
        named_parameters: ``(name, parameter)`` pairs of the module DDP wraps (the engine's keys).
        freeze_step: optimizer steps of plain Adam before the variance freezes (>= 1).
        units: ``"update"`` (momentum / frozen denominator, the default) or ``"momentum"``.
        momentum: ``"local"`` (default: ``exp_avg`` is each rank's own momentum) or ``"averaged"``
            (``exp_avg`` is the decoded average, the same on every rank); see the module docstring.
        variance_floor: floor of a frozen ``sqrt(v_hat)`` as a fraction of the tensor's mean.
        step_hook: register :meth:`before_optimizer_step` as the optimizer's step pre-hook (DDP).
            An integration whose ``step()`` first averages the gradients (Horovod's optimizer)
            passes ``False``, calls it itself once they are averaged, and sets :attr:`optimizer`
            to the optimizer it returns to the user.
    """

    def __init__(self, optimizer, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], freeze_step: int,
                 units: str = "update", variance_floor: float = 0.1, step_hook: bool = True,
                 momentum: str = "local"):
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
                          "uses 5% of the run at least), or the frozen denominators may be far off")
        if units not in UNITS:
            raise ValueError(f"units must be one of {UNITS}, got {units!r}")
        if momentum not in MOMENTA:
            raise ValueError(f"momentum must be one of {MOMENTA}, got {momentum!r}")
        if not 0.0 <= variance_floor <= 1.0:
            raise ValueError(f"variance_floor must be in [0, 1], got {variance_floor}")
        self.optimizer = optimizer
        self.names: Dict[Hashable, torch.nn.Parameter] = dict(unwrapped(named_parameters))
        managed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        unmanaged = [name for name, p in self.names.items() if id(p) not in managed and p.requires_grad]
        if unmanaged:
            raise ValueError(f"parameters {unmanaged[:5]} are not in the optimizer; the recipe needs every "
                             "parameter DDP averages to be stepped by it")
        self.freeze_step, self.units, self.variance_floor = freeze_step, units, float(variance_floor)
        self.momentum = momentum
        # Local momenta computed for the step in flight, per group of keys; the optimizer's
        # exp_avg takes them when the engine commits the step (momentum="local").
        self._pending: Dict[Tuple[Hashable, ...], List[Tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hook = optimizer.register_step_pre_hook(self._frozen_step) if step_hook else None

    def parameter_names(self):
        """The names this stage knows (the engine's keys)."""
        return set(self.names)

    # -- reading the optimizer ------------------------------------------------------------
    def _groups(self) -> Dict[int, dict]:
        return {id(p): group for group in self.optimizer.param_groups for p in group["params"]}

    def _steps_done(self, param) -> int:
        step = self.optimizer.state.get(param, {}).get("step")
        return int(step) if step is not None else 0

    def frozen(self, param) -> bool:
        """Whether ``param``'s variance is frozen (its gradient is then the averaged momentum)."""
        return self._steps_done(param) >= self.freeze_step

    def _denom(self, param, group) -> torch.Tensor:
        state = self.optimizer.state[param]
        denom = state.get("frozen_denom")
        if denom is None:
            sqrt_v = state["exp_avg_sq"].sqrt() / math.sqrt(1 - group["betas"][1] ** self._steps_done(param))
            floor = float(sqrt_v.mean()) * self.variance_floor
            denom = state["frozen_denom"] = sqrt_v.clamp(min=floor).add_(group["eps"])
        return denom

    # -- the engine's transform protocol ----------------------------------------------------
    def before_compress(self, keys, numels, grad: torch.Tensor) -> torch.Tensor:
        """The local quantity to send (float32 ``[n]``): ``grad`` before the freeze, the local
        momentum (in update units: / denom) after. ``grad`` is not mutated."""
        params = [self._param(key) for key in keys]
        self._pending.pop(tuple(keys), None)
        if not any(self.frozen(p) for p in params):
            return grad
        groups = self._groups()
        out = torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
        local_momenta = []
        offset = 0
        for param, n in zip(params, numels):
            piece, target = grad[offset: offset + n].float(), out[offset: offset + n]
            offset += n
            if not self.frozen(param):
                target.copy_(piece)
                continue
            group = groups[id(param)]
            if group["weight_decay"] and not _decoupled(self.optimizer, group):
                piece = piece + group["weight_decay"] * param.detach().reshape(-1).float()
            exp_avg = self.optimizer.state[param]["exp_avg"].reshape(-1).float()
            torch.lerp(exp_avg, piece, 1 - group["betas"][0], out=target)
            if self.momentum == "local":
                local_momenta.append((self.optimizer.state[param]["exp_avg"], target.clone()))
            if self.units == "update":
                target.div_(self._denom(param, group).reshape(-1))
        if local_momenta:
            self._pending[tuple(keys)] = local_momenta
        return out

    dense = before_compress  # a dense step sends the same quantity, whole

    def after_compress(self, keys, payload, compressor, numel: int) -> None:
        pass

    def commit(self, keys, accept: Union[bool, torch.Tensor] = True) -> None:
        """With ``momentum="local"``, make each frozen parameter's local momentum of this step its
        ``exp_avg`` if ``accept`` (may be a 0-d device tensor); otherwise nothing to do."""
        for exp_avg, local in self._pending.pop(tuple(keys), ()):
            local = local.view_as(exp_avg).to(exp_avg.dtype)
            if isinstance(accept, torch.Tensor):
                exp_avg.copy_(torch.where(accept, local, exp_avg))
            elif accept:
                exp_avg.copy_(local)

    def _param(self, key) -> torch.nn.Parameter:
        try:
            return self.names[key]
        except KeyError:
            raise KeyError(f"FrozenVarianceAdam has no parameter named {key!r}; build it from the named_parameters() "
                           "of the module that DDP wraps") from None

    # -- the optimizer's step, after the freeze ---------------------------------------------
    def before_optimizer_step(self) -> None:
        """Apply the frozen-variance update to :attr:`optimizer`'s frozen parameters (see below)."""
        self._frozen_step(self.optimizer, (), {})

    @torch.no_grad()
    def _frozen_step(self, optimizer, args, kwargs) -> None:
        """Step pre-hook: apply the frozen-variance update to every frozen parameter with a
        gradient and clear its ``grad``, so the optimizer's own step skips it."""
        for group in optimizer.param_groups:
            beta1 = group["betas"][0]
            lr, wd = float(group["lr"]), group["weight_decay"]
            for param in group["params"]:
                if param.grad is None or not self.frozen(param):
                    continue
                state = optimizer.state[param]
                denom = self._denom(param, group)
                # The averaged momentum: in update units it is already divided by denom.
                average = param.grad * denom if self.units == "update" else param.grad
                if self.momentum == "averaged":
                    state["exp_avg"].copy_(average)
                t = self._steps_done(param) + 1
                if wd and _decoupled(optimizer, group):
                    param.mul_(1 - lr * wd)
                param.addcdiv_(average, denom, value=-lr / (1 - beta1**t))
                state["step"] += 1
                param.grad = None

    # -- settings and checkpoints (the numbers live in the optimizer's own state_dict) ----------
    def _recipe(self) -> dict:
        """The settings a checkpoint must have been saved with (the learning rate may change)."""
        return {"freeze_step": self.freeze_step, "units": self.units, "variance_floor": self.variance_floor,
                "momentum": self.momentum}

    def settings(self) -> dict:
        """Every setting that changes how a replica moves, one entry per argument of ``__init__``
        (the cross-rank check hashes them), the optimizer's param-group hyperparameters included."""
        return {**self._recipe(), "optimizer": optimizer_settings(self.optimizer),
                "named_parameters": tuple((name, p.numel()) for name, p in self.names.items()),
                "step_hook": self._hook is not None}

    def state_dict(self) -> dict:
        return self._recipe()

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict != self._recipe():
            raise ValueError(f"the checkpoint's FrozenVarianceAdam settings {state_dict} differ from this run's "
                             f"{self._recipe()}")

    def __repr__(self) -> str:
        return f"FrozenVarianceAdam({type(self.optimizer).__name__}, {self.settings()})"
