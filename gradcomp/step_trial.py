"""Whether the compression a policy chose makes the whole step faster, measured, not predicted.

:class:`gradcomp.policy.Auto` predicts each group's exchange from an alpha-beta link and kernel
timings. What the prediction leaves out decides close cases: the optimizer stage's work around a
compressed exchange, the engine's per-group work, a CPU that Gloo's thread shares with backward
(on the unshaped loopback of a 2-core machine the predicted saving was real for the wire and lost
on the CPU). So a choice that compresses anything is kept only if the *step* is measured faster.

A step's time runs from its first group's ``choose`` to the next step's: forward, backward, the
exchanges and the optimizer, as the user's loop runs them. The trial compares two arms:

- *dense*: the latest steps in which every group went dense (the warm-up's dense steps for the
  first decision; for a decision taken again while compressing, ``steps`` steps forced dense first,
  since the earlier dense steps ran on another link);
- *compressed*: the ``steps`` steps after the deciding step (which times the kernels and is
  skipped).

The ranks share the two medians (the slowest rank's count: every rank waits for the slowest), and
the compression is kept only if its median is at most ``1 - margin`` of the dense median. The
verdict is the same on every rank: all of them gathered the same numbers at the same step.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

__all__ = ["StepTrial"]

#: Steps of history kept (each: the step, its seconds, whether any group was compressed).
_KEPT = 64


class StepTrial:
    """Times whole steps and judges one choice at a time against dense steps.

    Args:
        steps: steps per arm (at least 2 are needed of the dense arm; 0: never judge, keep every choice).
        margin: the compressed median must be at most ``1 - margin`` of the dense median.
    """

    def __init__(self, steps: int, margin: float):
        self.steps, self.margin = int(steps), float(margin)
        self._history: List[Tuple[int, float, bool]] = []
        self._began: Optional[Tuple[int, float]] = None
        self._compressed_now = False
        self._dense_from = None      # dense steps before this one belong to another decision
        self._force_until = -1       # steps < this go dense (the dense arm, taken on demand)
        self._window: Optional[Tuple[int, int]] = None  # [first, last) steps of the compressed arm
        #: The last verdict: ``{"dense_step_s", "compressed_step_s", "kept"}`` or ``None``.
        self.verdict: Optional[Dict[str, object]] = None

    # -- per step --------------------------------------------------------------------------
    def new_step(self, step: int, hook: Optional[Callable[[str, float], float]] = None) -> None:
        """Close the previous step (its time and arm) and open ``step``. ``hook(arm, seconds) ->
        seconds`` replaces this rank's measured time of the closed step (tests)."""
        now = time.perf_counter()
        if self._began is not None:
            previous, began = self._began
            seconds = now - began
            arm = "compressed" if self._compressed_now else "uncompressed"
            seconds = float(hook(arm, seconds)) if hook else seconds
            self._history.append((previous, seconds, self._compressed_now))
            del self._history[:-_KEPT]
        if self._dense_from is None:
            self._dense_from = step + 1  # the first step carries the set-up
        self._began, self._compressed_now = (step, now), False

    def note(self, compressed: bool) -> None:
        """One group of this step went compressed (``True``) or dense."""
        self._compressed_now = self._compressed_now or compressed

    def forces_dense(self, step: int) -> bool:
        """Whether this step belongs to a dense arm taken on demand."""
        return step < self._force_until

    # -- one decision ----------------------------------------------------------------------
    def begin(self, step: int) -> None:
        """A decision that compresses something was taken at ``step``: schedule its trial."""
        if self.steps == 0 or self._window is not None:
            return
        if len(self._dense_since(self._dense_from)) >= 2:
            first = step + 1
        else:  # no dense steps of this decision's link: take them now
            self._dense_from = step
            self._force_until = step + self.steps
            first = self._force_until + 1  # the first compressed step runs the kernels cold
        self._window = (first, first + self.steps)

    def due(self, step: int) -> bool:
        """Whether the trial's compressed arm is complete at ``step`` (then call :meth:`judge`)."""
        return self._window is not None and step >= self._window[1]

    def judge(self, gather: Callable[[List[float]], List[float]]) -> bool:
        """Share both arms' medians across ranks; ``True``: keep the compression. A collective:
        ``gather(values)`` returns, per value, the slowest rank's (``inf`` where no rank measured it)."""
        first, last = self._window
        dense = self._dense_since(self._dense_from)[-self.steps:]
        compressed = [s for step, s, c in self._history if first <= step < last and c]
        local = [statistics.median(dense) if dense else float("nan"),
                 statistics.median(compressed) if compressed else float("nan")]
        dense_s, compressed_s = gather(local)
        # Unmeasured (inf) on either side is not "measured faster": dense.
        kept = math.isfinite(dense_s) and compressed_s <= (1 - self.margin) * dense_s
        self.verdict = {"dense_step_s": dense_s, "compressed_step_s": compressed_s, "kept": kept}
        self._window = None
        return kept

    def restart(self, step: int) -> None:
        """The link changed: earlier dense steps no longer speak for the next decision."""
        self._dense_from, self._window = step, None

    def _dense_since(self, first: int) -> List[float]:
        return [s for step, s, compressed in self._history if step >= first and not compressed]
