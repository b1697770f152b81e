"""Whether the compression a policy chose makes the whole step faster, measured, not predicted.

:class:`gradcomp.policy.Auto` predicts each group's exchange from an alpha-beta link and kernel
timings. What the prediction leaves out decides close cases: the optimizer stage's work around a
compressed exchange, the engine's per-group work, a CPU that Gloo's thread shares with backward
(on the unshaped loopback of a 2-core machine the predicted saving was real for the wire and lost
on the CPU). So a choice that compresses anything is kept only if the *step* is measured faster.

A step's time runs from its first group's ``choose`` to the next step's: forward, backward, the
exchanges and the optimizer, as the user's loop runs them. The trial takes the two arms in turn,
``steps`` cycles of three steps after the deciding step (which times the kernels, cold):

- *flush*: dense, untimed; it sends what the residuals hold, through the optimizer stage;
- *uncompressed*: dense and timed, with an optimizer stage that can step aside stepped aside
  (``suspends_stage``), as it is while every group goes dense;
- *compressed*: the choice, timed.

Each cycle's compressed step over its dense step is one paired ratio. On a shared 2-core machine
one step's time varies by 10-17 % and slow stretches last several steps, so two blocks of steps
taken one after the other measured the machine as much as the choice (a choice kept on 8 steps
against 8 earlier dense ones was 12 % slower when the steps were taken in turn); a ratio of
neighbouring steps cancels the stretches. The ranks share their medians (the slowest rank's count:
every rank waits for the slowest), and the compression is kept only if the median paired ratio is
at most ``1 - margin``. The verdict is the same on every rank: all of them gathered the same
numbers at the same step.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional

__all__ = ["StepTrial"]

#: A cycle's steps, in order (see the module docstring; the timed dense arm is "uncompressed": the
#: exchanges' names stay in gradcomp.exchanges).
CYCLE = ("flush", "uncompressed", "compressed")
#: The timed arms, the names a measurement hook gets.
TIMED = ("uncompressed", "compressed")


class StepTrial:
    """Times whole steps and judges one choice at a time against dense steps taken in turn with it.

    Args:
        steps: cycles (paired dense and compressed steps) per trial; 0: never judge, keep every choice.
        margin: the median paired ratio, compressed over dense, must be at most ``1 - margin``.
    """

    def __init__(self, steps: int, margin: float):
        self.steps, self.margin = int(steps), float(margin)
        self._began: Optional[tuple] = None      # (step, perf_counter) of the open step
        self._first: Optional[int] = None        # the running trial's first cycle step
        self._seconds: Dict[int, float] = {}     # step -> seconds, the running trial's timed steps
        #: The last verdict: ``{"dense_step_s", "compressed_step_s", "paired_ratio", "kept"}`` or ``None``.
        self.verdict: Optional[Dict[str, object]] = None
        #: The verdict of least paired ratio among those that kept nothing since the last :meth:`restart`.
        self.best_rejected: Optional[Dict[str, object]] = None

    # -- per step --------------------------------------------------------------------------
    def new_step(self, step: int, hook: Optional[Callable[[str, float], float]] = None) -> None:
        """Close the previous step (its time, if the trial times it) and open ``step``.
        ``hook(arm, seconds) -> seconds`` replaces this rank's measured time of a timed step (tests)."""
        now = time.perf_counter()
        if self._began is not None:
            previous, began = self._began
            arm = self.arm(previous)
            if arm in TIMED:
                seconds = now - began
                self._seconds[previous] = float(hook(arm, seconds)) if hook else seconds
        self._began = (step, now)

    def arm(self, step: int) -> Optional[str]:
        """``step``'s part in the running trial (a name of :data:`CYCLE`), ``None`` outside one."""
        if self._first is None or not self._first <= step < self._first + len(CYCLE) * self.steps:
            return None
        return CYCLE[(step - self._first) % len(CYCLE)]

    @property
    def running(self) -> bool:
        """Whether a trial has begun and not been judged."""
        return self._first is not None

    def forces_dense(self, step: int) -> bool:
        """Whether this step is one of the trial's dense ones."""
        return self.arm(step) in ("flush", "uncompressed")

    def suspends_stage(self, step: int) -> bool:
        """Whether an optimizer stage that can step aside does so for this step (the timed dense arm)."""
        return self.arm(step) == "uncompressed"

    # -- one decision ----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A decision that compresses something was taken at ``step``: its trial starts at the next step."""
        if self.steps == 0 or self._first is not None:
            return
        self._first, self._seconds = step + 1, {}

    def due(self, step: int) -> bool:
        """Whether the running trial's last cycle is over at ``step`` (then call :meth:`judge`)."""
        return self._first is not None and step >= self._first + len(CYCLE) * self.steps

    def judge(self, gather: Callable[[List[float]], List[float]]) -> bool:
        """Share the medians across ranks; ``True``: keep the compression. A collective: ``gather(values)``
        returns, per value, the slowest rank's (``inf`` where no rank measured it)."""
        dense, compressed, ratios = [], [], []
        for cycle in range(self.steps):
            at = self._first + len(CYCLE) * cycle
            d, c = self._seconds.get(at + 1), self._seconds.get(at + 2)
            dense += [d] if d is not None else []
            compressed += [c] if c is not None else []
            if d is not None and c is not None and d > 0:
                ratios.append(c / d)
        local = [statistics.median(v) if v else float("nan") for v in (dense, compressed, ratios)]
        dense_s, compressed_s, ratio = gather(local)
        # Unmeasured (inf) is not "measured faster": dense.
        kept = math.isfinite(ratio) and ratio <= 1 - self.margin
        self.verdict = {"dense_step_s": dense_s, "compressed_step_s": compressed_s, "paired_ratio": ratio,
                        "kept": kept}
        if not kept and math.isfinite(ratio) and (self.best_rejected is None
                                                  or ratio < self.best_rejected["paired_ratio"]):
            self.best_rejected = dict(self.verdict)
        self._first, self._seconds = None, {}
        return kept

    def would_win(self, slower_by_s: float) -> bool:
        """Whether the rejected choice that came closest (:attr:`best_rejected`) would now be kept, were its
        trial's dense steps ``slower_by_s`` longer (a link slower since: dense's exchanges take that much more)
        and its compressed steps as they were (what they send is a fraction of it). ``True`` where no measured
        rejection is held: nothing measured speaks against deciding again."""
        best = self.best_rejected
        if best is None or not math.isfinite(best["dense_step_s"]) or not math.isfinite(slower_by_s):
            return True
        dense_s = best["dense_step_s"]
        return best["paired_ratio"] * dense_s <= (1 - self.margin) * (dense_s + max(slower_by_s, 0.0))

    def restart(self, step: int) -> None:
        """The link changed at ``step``: a running trial measured the old one, and is dropped (and so are the
        rejections, :attr:`best_rejected`)."""
        self._first, self._seconds, self.best_rejected = None, {}, None
