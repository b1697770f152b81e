"""Adam's stage of the recipe: a frozen variance, and compression in Adam's own units.

The recipe gives a user's own ``torch.optim.Adam``/``AdamW`` 1-bit Adam's arrangement in place, with
``.grad`` keeping its meaning (the engine's ``after_average`` maps what was exchanged back to gradient units):

1. **Dense start** (the optimizer's first ``freeze_step`` steps): the user's own Adam on densely
   averaged gradients, untouched; its second moment ``exp_avg_sq`` is estimated there.
2. **Freeze**: at the first compressed step (``freeze_step``; with ``latest_freeze``, the first step after
   the first whose learning rate stopped rising, :mod:`gradcomp.optim.freeze_gate`) each parameter's denominator
   ``d = max(sqrt(v_hat), floor * mean sqrt(v_hat)) + eps`` is computed once from ``exp_avg_sq`` and
   kept in the optimizer's state (``"frozen_denom"``); the floor keeps never-updated coordinates from
   huge steps. A live variance would see error feedback's bursts (a coordinate sent once in ``T``
   steps carries ``T`` steps of gradient) and shrink every step by about ``sqrt(T)``.
3. **Compressed phase**: what ranks compress is divided by ``d`` (Adam's update units), so top-k
   picks the largest *updates* and a 2-bit level fits every coordinate whatever its scale; the
   average is multiplied back by ``d``. What is exchanged is the ``exchange`` setting:

   * ``"gradient"`` (the recipe's): each rank's gradient, with error feedback. ``.grad`` holds the
     average gradient; the step keeps ``exp_avg`` its exponential average (the same on every rank). Where a
     sparsifier held coordinates back, each late gradient is caught up (:mod:`.catch_up`): ``exp_avg`` takes the
     share ``c`` of the burst it would still hold had the gradients come on time, the parameter at once the rest,
     ``(1 - c)`` of it at the step's rate; the steps each coordinate waited are read from the average (the same
     on every rank) and kept in :attr:`catch_up`. Measured against the first moment exchanged below (top-k,
     AdamW, seed 0): charlm-small -1.1 % against +1.3 %, the GPT -3.5 % against -1.4 %
     (``experiments/results/research-topk-adam-catchup/``).
   * ``"momentum"`` (no recipe's since the catch-up): each rank's own first moment
     ``m_i = b1' m_i + (1 - b1') g_i`` (per rank, in :meth:`state_dict`), with error feedback; ``.grad`` holds
     the average of the first moments (in gradient units) and ``exp_avg`` becomes it; ``b1'`` gives up the wait
     a sparsifier's residual adds (:mod:`.delay`: 0.9 becomes 0.8 at top-k 1 %).

   A step pre-hook reads ``.grad`` as the loop left it (clipped, unscaled, ...) and applies
   ``p -= lr * m / (1 - b1^t) / d`` (AdamW: after ``p *= 1 - lr * wd``; Adam: ``wd * p`` joins the
   gradient), advances the step count and clears ``.grad`` so that the optimizer's own step leaves
   the parameter alone.
4. **A spike guard** (``spike_guard=True``, the recipe's under a quantizer): a step whose input jumps past its
   recent history in update units is scaled back to it, as Adam's live variance would absorb the jump
   (:mod:`gradcomp.optim.spike_guard`; error feedback's first compressed steps make such a jump). Not under a
   sparsifier's catch-up, whose bursts are owed gradients (charlm-small, 200 steps: the target at step 159 with
   the guard, 151 without, dense's 151).
   **A live level** (``live_level``; the default with ``exchange="gradient"``): each param group's frozen steps
   follow its gradients' mean square as Adam's live variance would, the per-coordinate shape staying frozen
   (:mod:`gradcomp.optim.live_level`; a variance frozen on the dense start's large early gradients under-steps).
   **Bounded steps** (``bounded=True``; not the recipe's) scale back a parameter's step whose root mean
   square in update units passes 1 (:func:`bounded_step`): it kept the shapes CNN from diverging under a
   variance frozen on its early plateau but held the language models back (``research-adam-bound/``).
5. **Refreshes** (``refresh``, the share of the variance each renews, ``variance_refresh.WEIGHT`` in the recipe;
   ``None``, the default: frozen for good): each time the steps since the last hold that share of Adam's
   bias-corrected variance, the variance takes a sample of what the exchange delivered (a sparsifier's average
   over each coordinate's wait, a quantizer's first moment) and the denominators freeze again from it
   (:mod:`gradcomp.optim.variance_refresh`; frozen for good, a long run keeps the dense start's level and shape).
6. **Stepping aside**: while a policy sends every group dense for a while (``Auto``, when a trial
   measured compressed steps no faster), :meth:`~FrozenVarianceAdam.suspend` hands the parameters
   back to the user's Adam, its variance live again and continuous with the frozen one;
   :meth:`~FrozenVarianceAdam.resume` freezes it again at that step when compression comes back.

Schedulers, a learning rate set by hand, param groups and ``optimizer.state_dict()`` keep working:
the stage reads the optimizer at every call and keeps no copy of its settings. ``amsgrad`` and
``maximize`` are refused (they change what the frozen step must be).
"""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Optional, Tuple, Union

import torch

from gradcomp.optim.adam_settings import (
    VARIANCE_FLOOR,
    check_optimizer,
    decoupled_weight_decay,
    frozen_denominators,
    optimizer_settings,
)
from gradcomp.optim.catch_up import Waits, share_table
from gradcomp.optim.delay import DELAY_STEPS
from gradcomp.optim.freeze_gate import FreezeGate
from gradcomp.optim.frozen_adam_load import prepare_load, state_dict
from gradcomp.optim.frozen_units import group_divisor, next_moments
from gradcomp.optim.frozen_update import bounded_step, caught_up_update, frozen_update
from gradcomp.optim.live_level import LiveLevel
from gradcomp.optim.spike_guard import SpikeGuard, guard_factor
from gradcomp.optim.step_hook import after_closure
from gradcomp.optim.stepping_aside import resume, suspend
from gradcomp.optim.variance_refresh import refresh_if_due
from gradcomp.setup import unwrapped_names

__all__ = ["FrozenVarianceAdam"]

class FrozenVarianceAdam:
    """The engine's ``transform`` that puts a ``torch.optim.Adam``/``AdamW`` on the frozen-variance recipe.

    Args:
        optimizer: the user's ``torch.optim.Adam`` or ``AdamW`` (mutated: a step pre-hook is
            registered; after the freeze its state gains ``"frozen_denom"`` per parameter).
        named_parameters: ``(name, parameter)`` of the averaged parameters (the engine's keys).
        freeze_step: optimizer steps of plain Adam before the variance freezes (>= 1).
        exchange: ``"gradient"`` or ``"momentum"`` (see the module docstring).
        delay_steps: with ``exchange="momentum"``, the delay the first moment gives up on a step a sparsifier
            compresses at density 1 % (:data:`~gradcomp.optim.delay.DELAY_STEPS`; 0: ``b1`` as it is).
        variance_floor: floor of a frozen ``sqrt(v_hat)`` as a fraction of the tensor's mean.
        bounded: scale back a frozen step whose root mean square passes 1 (the module docstring's point 4).
        latest_freeze: from ``freeze_step`` on, the freeze waits while a param group's learning rate still
            rises, up to this step (:mod:`gradcomp.optim.freeze_gate`); ``None``: at ``freeze_step``.
        freeze_cost: ``cost(delay) -> str``, what a later freeze costs, for its notice (the recipe's bytes).
        spike_guard: scale back frozen steps whose input jumps (the module docstring's point 4).
        live_level: one level per param group following its gradients (the module docstring's point 4);
            ``None``: with ``exchange="gradient"`` (the averaged gradient's level), not with ``"momentum"``.
        refresh: the share of the variance each refresh renews (the module docstring's point 5); ``None``: frozen
            for good (the default).
        step_hook: register :meth:`before_optimizer_step` as the optimizer's step pre-hook (DDP);
            in ``optimizer.step(closure)`` it runs after the closure (:mod:`gradcomp.optim.step_hook`).
            An integration whose ``step()`` first averages the gradients (Horovod's optimizer)
            passes ``False``, calls it itself, and sets :attr:`optimizer` to the optimizer it returns.
    """

    def __init__(self, optimizer, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], freeze_step: int,
                 exchange: str = "gradient", variance_floor: float = VARIANCE_FLOOR, step_hook: bool = True,
                 delay_steps: float = DELAY_STEPS, bounded: bool = False, latest_freeze: Optional[int] = None,
                 freeze_cost=None, spike_guard: bool = True, live_level: Optional[bool] = None,
                 refresh: Optional[float] = None):
        check_optimizer(optimizer, freeze_step, exchange, variance_floor)
        if not float(delay_steps) >= 0:
            raise ValueError(f"delay_steps must be >= 0, got {delay_steps!r}")
        if refresh is not None and not 0.0 < float(refresh) < 1.0:
            raise ValueError(f"refresh must be None or a share in (0, 1), got {refresh!r}")
        self.optimizer = optimizer
        self.names: Dict[Hashable, torch.nn.Parameter] = dict(unwrapped_names(named_parameters))
        managed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        unmanaged = [name for name, p in self.names.items() if id(p) not in managed and p.requires_grad]
        if unmanaged:
            raise ValueError(f"parameters {unmanaged[:5]} are not in the optimizer; the recipe needs every "
                             "parameter DDP averages to be stepped by it")
        self.freeze_step, self.exchange, self.variance_floor = freeze_step, exchange, float(variance_floor)
        self.delay_steps, self.bounded = (float(delay_steps) if exchange == "momentum" else 0.0), bool(bounded)
        #: Scales back a frozen step whose input jumps (:mod:`gradcomp.optim.spike_guard`); ``None``: off.
        self.guard: Optional[SpikeGuard] = SpikeGuard() if spike_guard else None
        #: Each param group's live level on its frozen steps (:mod:`gradcomp.optim.live_level`); ``None``: off.
        live = exchange == "gradient" if live_level is None else live_level
        self.level: Optional[LiveLevel] = LiveLevel() if live else None
        #: Stepped aside (:meth:`suspend`): the user's Adam runs as it is, its variance live again.
        self.suspended = False
        #: The optimizer step whose variance the denominators freeze (``None``: ``freeze_step``).
        self.frozen_at: Optional[int] = None
        #: The share of the variance a refresh renews (``None``: none), and the step of the last (``None``: none
        #: since the freeze): :mod:`gradcomp.optim.variance_refresh`.
        self.refresh, self.refreshed_at = (None if refresh is None else float(refresh)), None
        #: ``exchange="momentum"``: this rank's first moment per parameter name (float32, flat).
        self.moments: Dict[Hashable, torch.Tensor] = {}
        self._pending: Dict[Tuple[Hashable, ...], List[Tuple[Hashable, torch.Tensor]]] = {}
        #: ``exchange="gradient"``: the steps each coordinate a sparsifier held back has waited (:mod:`.catch_up`).
        self.catch_up = Waits()
        self._cleared: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []  # skipped by the optimizer's step, put back
        #: Per group (its keys): the denominators (``None`` where not frozen) and their flat copy (:meth:`divisor`).
        self.divisors: Dict[Tuple[Hashable, ...], Tuple[tuple, torch.Tensor]] = {}
        #: When the variance freezes: ``freeze_step``, or later while the learning rate rises (``latest_freeze``).
        self.gate = FreezeGate(freeze_step, latest_freeze, freeze_cost)
        # after_closure: in optimizer.step(closure) this step's gradients exist only after the closure.
        self._hook = None
        if step_hook:
            self._hook = optimizer.register_step_pre_hook(after_closure(self.before_optimizer_step))
            optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step())

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
        """Whether ``param``'s variance is frozen (its exchange is then compressed)."""
        return not self.suspended and self.compresses_at(self._steps_done(param))

    def compresses_at(self, step: int) -> bool:
        """Whether the variance is frozen by optimizer step ``step``, deciding the freeze there if it is
        still open (:class:`~gradcomp.optim.freeze_gate.FreezeGate`): the recipe's schedule asks it at each
        step from its dense start on, keeps the step dense while it is not, and shifts what follows by
        :attr:`FreezeGate.delay <gradcomp.optim.freeze_gate.FreezeGate.delay>`."""
        opened = self.gate.open_at(step)
        return opened is not None and step >= opened

    @property
    def freeze_delay(self) -> int:
        """Steps the freeze came after ``freeze_step`` (0 while undecided)."""
        return self.gate.delay

    def _denom(self, param, group) -> torch.Tensor:
        state = self.optimizer.state[param]
        denom = state.get("frozen_denom")
        if denom is None:
            # The variance stopped at the freeze (or the last refresh): its bias correction is that step's,
            # whenever the denominator is computed (also from a checkpoint that lacks it).
            denom = state["frozen_denom"] = frozen_denominators(
                [state["exp_avg_sq"]], group["betas"][1], self.variance_at(), self.variance_floor, group["eps"])[0]
        return denom

    def _frozen_at(self) -> int:
        if self.frozen_at is not None:
            return self.frozen_at
        return self.freeze_step if self.gate.opened is None else self.gate.opened

    def variance_at(self) -> int:
        """The optimizer step whose variance the denominators hold: the last refresh's, else the freeze's."""
        return self.refreshed_at if self.refreshed_at is not None else self._frozen_at()

    # -- stepping aside while nothing is compressed (:mod:`.stepping_aside`) -------------------
    def suspend(self) -> None:
        """Step aside: the user's Adam runs as it is, with a live variance, until :meth:`resume`
        (:func:`~.stepping_aside.suspend`; mutates the optimizer's state)."""
        suspend(self)

    def resume(self) -> None:
        """Come back after :meth:`suspend`: the variance freezes again at this step's
        (:func:`~.stepping_aside.resume`)."""
        resume(self)

    def _pieces(self, keys, numels, flat: torch.Tensor):
        """``(key, parameter, its group, its slice of flat)`` of the frozen parameters laid out in ``flat``."""
        groups, offset = self._groups(), 0
        for key, n in zip(keys, numels):
            param = self._param(key)
            if self.frozen(param):
                yield key, param, groups[id(param)], flat[offset: offset + n]
            offset += n

    def _denoms(self, pieces, dtype: Optional[torch.dtype] = None) -> List[torch.Tensor]:
        """The frozen denominators of :meth:`_pieces`' parameters, flat (in ``dtype`` if given)."""
        denoms = [self._denom(param, group).reshape(-1) for _, param, group, _ in pieces]
        return denoms if dtype is None else [denom.to(dtype) for denom in denoms]

    def _param(self, key) -> torch.nn.Parameter:
        try:
            return self.names[key]
        except KeyError:
            raise KeyError(f"FrozenVarianceAdam has no parameter named {key!r}") from None

    # -- the engine's transform protocol ----------------------------------------------------
    def before_compress(self, keys, numels, grad: torch.Tensor, compressor=None) -> torch.Tensor:
        """What this rank compresses (float32 ``[n]``, a new tensor): ``grad``, or with
        ``exchange="momentum"`` this rank's next first moment (``b1'`` of ``compressor``'s density when it
        sparsifies, else ``b1``; ``None``: a dense step), divided by the frozen denominator for frozen
        parameters. ``grad`` is not mutated; the moments change at :meth:`commit`."""
        divisor = group_divisor(self, keys, numels) if self.exchange == "gradient" else None
        out = grad.float().clone() if divisor is None else grad.float() / divisor  # one pass, no copy
        if divisor is not None:
            return out
        pieces = list(self._pieces(keys, numels, out))
        pending = next_moments(self, pieces, compressor) if self.exchange == "momentum" else []
        if pieces:  # one multi-tensor op for the group: one kernel launch on a GPU, not one per parameter
            torch._foreach_div_([piece for *_, piece in pieces], self._denoms(pieces))
        if self.bounded and self.exchange == "momentum":
            for *_, piece in pieces:
                piece.div_(bounded_step(piece))
        self._pending[tuple(keys)] = pending
        return out

    def dense(self, keys, numels, grad: torch.Tensor) -> torch.Tensor:
        """What a dense step (the schedule's, a policy's) sends: the same quantity as :meth:`before_compress`,
        whole, so that the residuals flushed into it are in its units; before the freeze, or suspended,
        that is the gradient itself (``grad``, returned as it is: nothing to copy)."""
        self.catch_up.drop(keys)
        if self.suspended:
            return grad
        return self.before_compress(keys, numels, grad)

    def divisor(self, keys, numels) -> Optional[torch.Tensor]:
        """All that :meth:`before_compress` and :meth:`after_average` do to the group of ``keys``, as one tensor:
        float32 ``[n]``, each frozen parameter's denominator and 1.0 elsewhere, or ``None`` where they do more
        (``exchange="momentum"``) or nothing (suspended, nothing frozen): :func:`~.frozen_units.group_divisor`."""
        return group_divisor(self, keys, numels) if self.exchange == "gradient" and not self.suspended else None

    def after_compress(self, keys, payload, compressor, numel: int) -> None:
        """With ``exchange="gradient"``: ``keys`` wait where ``compressor`` holds coordinates back (a sparsifier)."""
        if self.exchange == "gradient":
            self.catch_up.record(keys, compressor)

    def after_average(self, keys, numels, average: torch.Tensor, dense: bool) -> None:
        """Back to gradient units: the average times the frozen denominator (frozen parameters)."""
        if self.suspended:  # nothing is frozen (see frozen); skip the walk over the group's parameters
            return
        divisor = group_divisor(self, keys, numels) if self.exchange == "gradient" else None
        if divisor is not None and average.dtype == torch.float32:  # one pass: ``x * 1.0`` is ``x``
            average.mul_(divisor)
        elif pieces := list(self._pieces(keys, numels, average)):
            torch._foreach_mul_([piece for *_, piece in pieces], self._denoms(pieces, average.dtype))

    def commit(self, keys, accept: Union[bool, torch.Tensor] = True) -> None:
        """Make this step's first moments the moments if ``accept`` (may be a 0-d device tensor)."""
        if isinstance(accept, torch.Tensor) and accept.device.type == "cpu":
            accept = bool(accept)  # no device to wait for: one test, not a torch.where per parameter
        for key, moment, old in self._pending.pop(tuple(keys), ()):
            if isinstance(accept, torch.Tensor):  # decided on the device: no host sync here
                self.moments[key] = torch.where(accept, moment, old)
            else:  # a rejected step keeps where the moment was (Adam's exp_avg on the first compressed step)
                self.moments[key] = moment if accept else old

    # -- the optimizer's step, after the freeze ---------------------------------------------
    @torch.no_grad()
    def before_optimizer_step(self) -> None:
        """The frozen-variance update of every frozen parameter of :attr:`optimizer` with a gradient
        (before the optimizer's own step; one param group at a time, :func:`frozen_update`, or where a sparsifier
        held coordinates back :func:`caught_up_update`, advancing their waits); clears its ``grad`` so that the
        optimizer's own step skips it, until :meth:`after_optimizer_step` puts it back."""
        optimizer = self.optimizer
        self._cleared = []
        late = {id(self.names[key]): key for key in self.catch_up.begin_step() if key in self.names}
        # each parameter with a gradient: its optimizer steps done, read once a step (a state lookup per read)
        done = {id(p): self._steps_done(p) for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None}
        refresh_if_due(self, done)
        factor, plain = guard_factor(self, done)
        for index, group in enumerate(optimizer.param_groups if not self.suspended else ()):  # suspended: none frozen
            params = [p for p in group["params"] if id(p) in done and self.compresses_at(done[id(p)])]  # frozen(p)
            if not params:
                continue
            self.gate.watch(index, group, done[id(params[0])] - self._frozen_at())
            states, denoms = [optimizer.state[p] for p in params], [self._denom(p, group) for p in params]
            grads = [p.grad for p in params]
            scale = factor  # the guard's factor joins the group's level: one pass over the gradients
            if self.level is not None:
                norms = None if plain is None else plain[1][[plain[0][id(p)] for p in params]]
                scale = self.level.factor(index, grads, denoms, group["betas"][1], group["eps"], factor, norms)
            exp_avgs, steps = [state["exp_avg"] for state in states], [done[id(p)] + 1 for p in params]
            decoupled, keys = decoupled_weight_decay(optimizer, group), [late[id(p)] for p in params if id(p) in late]
            if keys:  # a sparsifier held coordinates back: each late gradient caught up
                waits = iter(self.catch_up.waits_of(keys, [p for p in params if id(p) in late]))
                caught_up_update(params, exp_avgs, grads, denoms, steps, group, decoupled, self.bounded, scale,
                                 [next(waits) if id(p) in late else None for p in params],
                                 share_table(float(group["betas"][0]), params[0].device))
            else:
                frozen_update(params, exp_avgs, grads, denoms, steps, group, decoupled, self.exchange, self.bounded,
                              scale)
            for param, state in zip(params, states):
                state["step"] += 1
                self._cleared.append((param, param.grad))
                param.grad = None
        self.gate.record(optimizer)

    def after_optimizer_step(self) -> None:
        """Put back the gradients :meth:`before_optimizer_step` cleared (each ``param.grad`` is
        mutated): after ``optimizer.step()`` a loop sees ``.grad`` as it would without gradcomp."""
        for param, grad in self._cleared:
            if param.grad is None:  # a loop that set a gradient meanwhile keeps its own
                param.grad = grad
        self._cleared = []

    # -- settings and checkpoints -------------------------------------------------------------
    def _recipe(self) -> dict:
        """The settings a checkpoint must have been saved with (the learning rate may change)."""
        return {"freeze_step": self.freeze_step, "exchange": self.exchange, "variance_floor": self.variance_floor,
                "delay_steps": self.delay_steps, "bounded": self.bounded, "latest_freeze": self.gate.latest,
                "spike_guard": self.guard is not None, "live_level": self.level is not None, "refresh": self.refresh}

    def settings(self) -> dict:
        """Every setting that changes how a replica moves (the cross-rank check hashes them)."""
        return {**self._recipe(), "optimizer": optimizer_settings(self.optimizer),
                "named_parameters": tuple((name, p.numel()) for name, p in self.names.items()),
                "step_hook": self._hook is not None}

    def state_dict(self) -> dict:
        """The settings, whether the stage is suspended and where the variance froze, the guard's and the levels'
        averages, and with ``exchange="momentum"`` this rank's first moments (CPU float32)."""
        return state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`; raises ``ValueError`` (changing nothing) if it does not fit."""
        self.prepare_load(state_dict)()

    def prepare_load(self, state_dict: dict):
        """Validate :meth:`state_dict`'s output and return the function that assigns it (the engine's
        checkpoint validates every part before it assigns any). Raises ``ValueError``, changing nothing."""
        return prepare_load(self, state_dict)

    def reset(self) -> None:
        """Forget this rank's first moments and the waits (the residuals were reset: nothing is held back): the
        next compressed step starts from the optimizer's own ``exp_avg``, the same on every rank."""
        self.moments = {}
        self._pending.clear()
        self.catch_up.clear()

    def __repr__(self) -> str:
        return f"FrozenVarianceAdam({type(self.optimizer).__name__}, {self._recipe()})"
