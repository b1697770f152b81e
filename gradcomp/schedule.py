"""Warm-up schedules: which compressor (or a dense step) each training step uses.

Error feedback started inside the learning-rate warm-up stores the large early gradients and
releases them many steps late: measured on charlm-small (2 ranks, seed 0) a sent top-k entry
was on average 36 steps old and 74% of the sent norm was old residual when compression began
after 2 dense steps. A schedule fixes that by starting dense and tightening step by step.

A schedule is a pure function of the step number (the engine owns the step), so every rank
computes the same payload size at every step with no communication. Its ``state_dict`` holds
its settings; loading checks them, because resuming with a different schedule would silently
change the run.

=====================  =======================================================================
:class:`DenseWarmup`   ``dense_steps`` dense steps, then the base compressor (the engine's
                       default, what ``warmup_steps`` did before schedules existed)
:class:`SparsityRamp`  DGC's exponential ramp for top-k: dense steps, then densities
                       25% -> 6.25% -> 1.56% -> 0.39% (each ``stage_steps`` long), skipping
                       stages no denser than the base's, then the base; other compressors
                       get the dense steps only
:func:`recommended`    the measured default for a compressor (see below)
=====================  =======================================================================

Defaults, from measurements (charlm-small, 2 ranks, seed 0: a single-process simulation of the
2 ranks that reproduced the DDP runs to 3-4 decimals, and the convergence study,
``python -m experiments.convergence``):

* top-k 1%: 2 dense steps (DDP's bucket rebuild), then the ramp with 100-step stages. With
  DGC's momentum correction this ended 1.3% above the dense held-out loss at 2000 steps
  through the real DDP path (SGD-momentum: 1.662 vs 1.640; the simulation: 1.654 vs 1.646),
  against +50% for compression from step 2 without a ramp (AdamW, simulation). Its bytes over
  2000 steps: 17x fewer than dense (measured, small tensors dense included).
* 2-bit: 100 dense steps, then 2-bit. 2-bit codes cost 1/16 of float32, so 100 dense steps
  of 2000 keep the run at 1/9 of dense bytes (the goal is 1/8); 40 dense steps already fixed
  most of the early-residual damage at 200 steps (3.06 -> 2.60 held-out loss).

:class:`PlannedSchedule` wraps the one-call recipe's schedule and says when a run outgrows its plan (and sends
its dense start in 16 bits); :func:`gradcomp.lr_schedule.lr_peak_step` reads where an LR scheduler's warm-up ends;
:class:`CodeSwitch` is how the recipe keeps its byte budget after a dense start held past its plan.

Example::

    >>> schedule = SparsityRamp(dense_steps=2, stage_steps=100)
    >>> [schedule.compressor_at(s, TopK(0.01)) for s in (0, 2, 102, 302)]
    [None, TopK(density=0.25), TopK(density=0.0625), TopK(density=0.01)]
"""
from __future__ import annotations

import atexit
import copy
import weakref
from typing import Dict, Optional, Sequence, Tuple

from gradcomp.compressors.base import Compressor
from gradcomp.compressors.topk import TopK

__all__ = ["DenseWarmup", "SparsityRamp", "CodeSwitch", "PlannedSchedule", "recommended", "DGC_DENSITIES"]

#: DGC's ramp (Lin et al., 2018): sparsity 75%, 93.75%, 98.4375%, 99.6%: density divided by 4.
DGC_DENSITIES: Tuple[float, ...] = (0.25, 0.0625, 0.015625, 0.00390625)
DEFAULT_STAGE_STEPS = 100
TOPK_DENSE_STEPS = 2
TWOBIT_DENSE_STEPS = 100
#: Steps a :class:`PlannedSchedule` with a ``start`` compressor keeps dense: DDP's first step and its bucket rebuild.
EXACT_DENSE_STEPS = 2


def _check_count(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return step


def _density_of(compressor: TopK) -> float:
    """A top-k compressor's fraction of entries kept."""
    return float(compressor.density)


def _with_density(compressor: TopK, density: float) -> TopK:
    """A copy of ``compressor`` with every other setting kept and ``density`` entries kept."""
    changed = copy.copy(compressor)
    if "density" in vars(changed):
        changed.density = float(density)
    if _density_of(changed) != float(density):
        raise TypeError(f"cannot set the density of {compressor!r}; a ramp needs TopK's density attribute")
    return changed


class DenseWarmup:
    """``dense_steps`` dense steps, then ``base`` unchanged.

    Args:
        dense_steps: steps ``0 .. dense_steps - 1`` are dense (``compressor_at`` returns ``None``).
    """

    kind = "dense_warmup"

    def __init__(self, dense_steps: int = TOPK_DENSE_STEPS):
        self.dense_steps = _check_count("dense_steps", dense_steps)

    def compressor_at(self, step: int, base: Compressor) -> Optional[Compressor]:
        """The compressor of ``step`` (``None``: a dense step). Depends only on ``step`` and
        ``base``'s settings, so it is the same on every rank."""
        return None if _check_step(step) < self.dense_steps else base

    def settings(self) -> Dict[str, object]:
        return {"kind": self.kind, "dense_steps": self.dense_steps}

    def state_dict(self) -> Dict[str, object]:
        """The settings (plain Python values; the step is the engine's)."""
        return self.settings()

    def load_state_dict(self, state_dict: Dict[str, object]) -> None:
        """Check that ``state_dict`` was saved by an identically configured schedule; raise
        ``ValueError`` naming the difference otherwise (nothing is changed either way)."""
        if not isinstance(state_dict, dict):
            raise ValueError(
                f"expected the dict from {type(self).__name__}.state_dict(), got {type(state_dict).__name__}"
            )
        mine = self.settings()
        theirs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in state_dict.items()}
        if theirs != mine:
            raise ValueError(
                f"the checkpoint was saved with schedule {theirs} but this run uses {mine}; "
                "resume with the same schedule, or start the schedule afresh (the recipe's plan reads "
                "register(..., scheduler=)'s warm-up from the run's first step: register before loading the "
                "scheduler's state where it cannot be rewound, as a SequentialLR)"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dense_steps={self.dense_steps})"


class SparsityRamp(DenseWarmup):
    """DGC's exponential sparsity warm-up for top-k.

    Step ``s`` is dense while ``s < dense_steps``; then stage ``j = (s - dense_steps) //
    stage_steps`` keeps ``densities[j]`` of the entries, for the stages whose density is above
    the base compressor's; after them the base compressor runs unchanged. Compressors other
    than :class:`~gradcomp.TopK` only get the dense steps (a precision warm-up).

    Args:
        dense_steps: dense steps first (>= 0).
        stage_steps: length of each ramp stage in steps (>= 1).
        densities: the ramp's densities, strictly decreasing, each in (0, 1].
    """

    kind = "sparsity_ramp"

    def __init__(
        self,
        dense_steps: int = TOPK_DENSE_STEPS,
        stage_steps: int = DEFAULT_STAGE_STEPS,
        densities: Sequence[float] = DGC_DENSITIES,
    ):
        super().__init__(dense_steps)
        self.stage_steps = _check_count("stage_steps", stage_steps, minimum=1)
        densities = tuple(float(d) for d in densities)
        if not densities or any(not 0.0 < d <= 1.0 for d in densities):
            raise ValueError(f"densities must be a non-empty sequence of numbers in (0, 1], got {densities!r}")
        if any(later >= earlier for earlier, later in zip(densities, densities[1:])):
            raise ValueError(f"densities must decrease strictly, got {densities!r}")
        self.densities = densities
        self._cache_base: Optional[Compressor] = None
        self._cache: Dict[int, Compressor] = {}

    def stages(self, base: Compressor) -> Tuple[float, ...]:
        """The ramp densities that apply before ``base`` (those above its density)."""
        if not isinstance(base, TopK):
            return ()
        final = _density_of(base)
        return tuple(d for d in self.densities if d > final)

    def compressor_at(self, step: int, base: Compressor) -> Optional[Compressor]:
        if _check_step(step) < self.dense_steps:
            return None
        stages = self.stages(base)
        stage = (step - self.dense_steps) // self.stage_steps
        if stage >= len(stages):
            return base
        if base is not self._cache_base:  # a new base: forget copies made from the old one
            self._cache_base, self._cache = base, {}
        compressor = self._cache.get(stage)
        if compressor is None:
            compressor = self._cache[stage] = _with_density(base, stages[stage])
        return compressor

    def ramp_end(self, base: Compressor) -> int:
        """The first step that uses ``base`` unchanged."""
        return self.dense_steps + len(self.stages(base)) * self.stage_steps

    def settings(self) -> Dict[str, object]:
        return {**super().settings(), "stage_steps": self.stage_steps, "densities": self.densities}

    def __repr__(self) -> str:
        return (
            f"SparsityRamp(dense_steps={self.dense_steps}, stage_steps={self.stage_steps}, "
            f"densities={self.densities})"
        )


class CodeSwitch(DenseWarmup):
    """``dense_steps`` dense steps, ``base`` until ``switch_step``, then ``later`` to the end.

    The recipe's 3-bit plan after Adam's freeze waited past its planned step: the extra dense steps are
    paid back by the cheaper ``later`` code (the ternary one) over the run's last steps, where the learning
    rate is at its smallest. Measured against the same steps right after the freeze (the GPT without its
    clip, AdamW, 1000 steps, 96 ternary steps, seeds 0-2): -1.6/-2.5/-2.4 % against dense at the end,
    -2.8/-2.4/-1.8 % after the freeze; alike (``experiments/results/research-steady-freeze/``).

    Args:
        dense_steps: steps ``0 .. dense_steps - 1`` are dense.
        switch_step: the first step of ``later`` (>= ``dense_steps``).
        later: the compressor of every step from ``switch_step`` on.
    """

    kind = "code_switch"

    def __init__(self, dense_steps: int, switch_step: int, later: Compressor):
        super().__init__(dense_steps)
        self.switch_step = _check_count("switch_step", switch_step, minimum=self.dense_steps)
        self.later = later

    def compressor_at(self, step: int, base: Compressor) -> Optional[Compressor]:
        if _check_step(step) < self.dense_steps:
            return None
        return base if step < self.switch_step else self.later

    def settings(self) -> Dict[str, object]:
        return {**super().settings(), "switch_step": self.switch_step, "later": self.later.spec}

    def __repr__(self) -> str:
        return f"CodeSwitch(dense_steps={self.dense_steps}, switch_step={self.switch_step}, later={self.later!r})"


def recommended(compressor: Compressor) -> DenseWarmup:
    """The measured default schedule for ``compressor`` (see the module docstring): the DGC
    ramp for top-k, 100 dense steps for 2-bit, 2 dense steps for anything else."""
    if isinstance(compressor, TopK):
        return SparsityRamp(TOPK_DENSE_STEPS, DEFAULT_STAGE_STEPS)
    if type(compressor).__name__ == "TwoBit":
        return DenseWarmup(TWOBIT_DENSE_STEPS)
    return DenseWarmup(TOPK_DENSE_STEPS)


class PlannedSchedule:
    """The recipe's schedule (``inner``), which also notices a run that outgrows its plan.

    Delegates ``compressor_at``, ``settings``, ``state_dict`` and ``load_state_dict`` to ``inner``
    (checkpoints and the cross-rank check see ``inner`` alone). Past ``total_steps`` it keeps the
    final setting and says so once; at interpreter exit a run that stopped before half of
    ``total_steps`` says so too (its dense start and ramp were sized for the whole run).

    ``gate``: an optimizer stage whose ``compresses_at(step)`` may hold the dense start past ``inner``'s
    (Adam's freeze waiting for the learning rate to stop rising, :mod:`gradcomp.optim.freeze_gate`): such
    steps are the dense start's (dense, or ``start``), and the steps after them follow
    ``replan(gate.freeze_delay)``, the plan for the later dense start (the recipe's keeps the byte budget),
    or without ``replan`` ``inner``'s plan as many steps late. The delay is kept in the stage's checkpoint,
    so a resumed run re-plans alike.

    ``start``: the compressor of the dense start's steps from step :data:`EXACT_DENSE_STEPS` on (the recipe's
    :class:`~gradcomp.compressors.FP16`: half the bytes, no residual; ``None``: they are dense). The first
    steps stay dense, so DDP rebuilds its buckets on exact gradients.
    """

    def __init__(self, inner, total_steps: int, announce: bool = True, gate=None, replan=None,
                 start: Optional[Compressor] = None):
        self.inner, self.total_steps, self.announce, self.gate = inner, total_steps, announce, gate
        self.replan, self.start = replan, start
        self._replanned: Tuple[int, object] = (0, inner)
        self.dense_steps = getattr(inner, "dense_steps", None)
        self.furthest = -1
        self._said_longer = False
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._say_if_short())

    def compressor_at(self, step: int, base: Compressor) -> Optional[Compressor]:
        planned = self._planned(step, base)
        if planned is None and self.start is not None and step >= EXACT_DENSE_STEPS:
            return self.start
        return planned

    def _planned(self, step: int, base: Compressor) -> Optional[Compressor]:
        """The plan's compressor of ``step`` (``None``: a step of the dense start)."""
        self.furthest = max(self.furthest, step)
        if step >= self.total_steps and not self._said_longer:
            self._said_longer = True
            from gradcomp.setup import notice

            notice(f"the run reached step {step}, past the total_steps={self.total_steps} its recipe was planned "
                   "for (register(..., total_steps=) counts optimizer steps); it keeps the final setting",
                   self.announce)
        if self.gate is not None and self.dense_steps is not None and step >= self.dense_steps:
            if not self.gate.compresses_at(step):
                return None
            delay = self.gate.freeze_delay
            if self.replan is None:
                step -= delay
            elif delay:
                if self._replanned[0] != delay:  # decided once; a resumed run decides it again alike
                    self._replanned = (delay, self.replan(delay))
                return self._replanned[1].compressor_at(step, base)
        return self.inner.compressor_at(step, base)

    def _say_if_short(self) -> None:
        if 0 <= self.furthest < self.total_steps // 2 - 1:
            from gradcomp.setup import notice

            notice(f"the run ended after {self.furthest + 1} of the {self.total_steps} steps its recipe was planned "
                   "for; its dense start and ramp were sized for the whole run", self.announce)

    def settings(self):
        return self.inner.settings()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return repr(self.inner)
