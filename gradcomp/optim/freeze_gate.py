"""When Adam's variance freezes: at the planned step, or later while the learning rate still rises.

The recipe plans the dense start from the run's length, its byte budget and an LR scheduler when one is
passed. A loop that sets the learning rate by hand (most single-file GPT scripts) hides its warm-up from
that plan, and a variance frozen inside the warm-up describes the warm-up's first gradients: an unclipped
GPT under AdamW, 2-bit, froze so at 9 and at 17 steps of its 20-step warm-up and did not train (+27.7 %
held-out loss over dense at 200 steps, NaN at 1000); held past the warm-up (21 dense steps) the same runs
ended +1.6 % and -2.1 % (``experiments/results/research-steady-freeze/``).

A :class:`FreezeGate` with a ``latest`` step reads each param group's learning rate at every optimizer step
(the loop's own or a scheduler's; :meth:`~FreezeGate.record`, from the step pre-hook) and opens, from
``freeze_step`` on, at the first step after one whose rates were no higher than the step before's, at
``latest`` at the latest. The rates are read at the optimizer's step, where they are this step's whether the
loop set them before ``backward()`` or just before ``optimizer.step()``; the exchange of a step comes before
its optimizer step, so a step's decision rests on the steps before it. Until the gate opens the step stays
dense (the recipe's schedule asks, and shifts what follows by the delay). Every rank reads the same rates, so
every rank opens at the same step. Without ``latest`` it opens at ``freeze_step``, as a planned freeze.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

__all__ = ["FreezeGate", "RISE"]

#: A rate above the previous step's by more than this fraction is rising (float rounding of a flat rate is not).
RISE = 1e-6


def _rates(optimizer) -> Tuple[float, ...]:
    return tuple(float(group["lr"]) for group in optimizer.param_groups)


def _rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


class FreezeGate:
    """The step Adam's variance freezes at (module docstring).

    Args:
        freeze_step: the earliest step (optimizer steps of plain Adam first, >= 1).
        latest: the latest step (>= ``freeze_step``); ``None``: the freeze is at ``freeze_step``.
        cost: what a delay of ``n`` steps costs, in words for the notice (the recipe's bytes), or ``None``.
    """

    def __init__(self, freeze_step: int, latest: Optional[int] = None,
                 cost: Optional[Callable[[int], str]] = None):
        if latest is not None and (isinstance(latest, bool) or not isinstance(latest, int) or latest < freeze_step):
            raise ValueError(f"latest_freeze must be an integer >= freeze_step ({freeze_step}), got {latest!r}")
        self.freeze_step, self.latest, self.cost = freeze_step, latest, cost
        #: The step the variance freezes at (``None``: still open, the learning rate rising so far).
        self.opened: Optional[int] = freeze_step if latest is None or latest == freeze_step else None
        #: Each param group's learning rate at the last optimizer step (``None``: none seen yet).
        self.lr_seen: Optional[Tuple[float, ...]] = None
        #: Whether a rate rose at the last optimizer step from the one before.
        self.rising = False
        self._lr_at_freeze: dict = {}
        self._warned_warmup = False

    @property
    def delay(self) -> int:
        """Steps the freeze came after ``freeze_step`` (0 while open)."""
        return 0 if self.opened is None else self.opened - self.freeze_step

    def open_at(self, step: int) -> Optional[int]:
        """The step the variance freezes at, decided at ``step`` if the gate is still open there
        (``None``: not at ``step``: the learning rate rose at the last optimizer step)."""
        if self.opened is None and step >= self.freeze_step and (not self.rising or step >= self.latest):
            self.opened = step
            if self.delay:
                self._say_delayed(self.rising)
        return self.opened

    def record(self, optimizer) -> None:
        """Note this optimizer step's learning rates, and whether one rose from the last step's (called once
        per optimizer step, after this step's decision)."""
        rates = _rates(optimizer)
        self.rising = self.lr_seen is not None and any(now > before * (1 + RISE)
                                                       for now, before in zip(rates, self.lr_seen))
        self.lr_seen = rates

    def _say_delayed(self, rising: bool) -> None:
        from gradcomp.setup import notice  # the set-up imports the stages

        cost = f"; {self.cost(self.delay)}" if self.cost is not None else ""
        cause = ("the learning rate still rising there (the latest step this run's plan allows)" if rising
                 else "the step after the first whose learning rate did not rise")
        notice(f"Adam's variance froze at step {self.opened}, {cause}, not at the planned step "
               f"{self.freeze_step}: {self.delay} more dense steps for a warm-up the plan could not see "
               f"(a learning rate set by hand; register(..., scheduler=...) plans it ahead){cost}", _rank0())

    def watch(self, index: int, group: dict, since_freeze: int) -> None:
        """Say once (a :class:`~gradcomp.setup.RecipeNotice`, rank 0) when param group ``index``'s learning rate
        rises within ``freeze_step`` steps after the freeze: the variance then froze inside a warm-up longer than
        the dense start (a scheduler's warm-up the byte budget cut short, a rate that rises in stairs, a gate
        closed at its latest step). Reads ``group["lr"]``; changes nothing."""
        lr = float(group["lr"])
        first = self._lr_at_freeze.setdefault(index, lr)
        if self._warned_warmup or since_freeze > self.freeze_step or not lr > first * 1.01:
            return
        from gradcomp.setup import notice

        self._warned_warmup = True
        notice(f"Adam's variance froze after {self.opened} steps, but param group {index}'s learning rate "
               f"kept rising after it ({first:.3g} at the freeze, {lr:.3g} {since_freeze} steps later): the freeze "
               "fell inside a warm-up longer than the dense start, and the frozen denominators describe the "
               "warm-up's first gradients (an unclipped GPT froze so and did not train). Clipping the gradient's "
               "norm kept every such run training", _rank0())

    def state_dict(self) -> dict:
        return {"opened": self.opened, "lr_seen": None if self.lr_seen is None else list(self.lr_seen),
                "rising": self.rising}

    def prepare_load(self, state: dict) -> Callable[[], None]:
        """Check a :meth:`state_dict` (``{}``: saved before the gate; a planned freeze) and return what assigns
        it; raises ``ValueError``, changing nothing."""
        opened, seen, rising = state.get("opened", self.freeze_step), state.get("lr_seen"), state.get("rising", False)
        if self.latest is None:
            opened = self.freeze_step  # a planned freeze (the settings, compared apart, say the same)
        elif "opened" not in state:
            opened = None  # saved before the gate existed: this run's decides
        if opened is not None and (type(opened) is not int or opened < self.freeze_step):
            raise ValueError(f"the checkpoint's freeze opened at {opened!r}, before this run's freeze_step "
                             f"{self.freeze_step} or not a step")
        if seen is not None and (not isinstance(seen, (list, tuple))
                                 or not all(type(r) in (int, float) for r in seen)):
            raise ValueError(f"the checkpoint's learning rates {seen!r} are not a list of numbers")
        if not isinstance(rising, bool):
            raise ValueError(f"the checkpoint's rising flag {rising!r} is not a bool")

        def assign() -> None:
            self.opened, self.lr_seen = opened, None if seen is None else tuple(float(r) for r in seen)
            self.rising = rising

        return assign
