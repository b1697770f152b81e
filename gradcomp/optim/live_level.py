"""One live level per param group on the frozen variance: its shape frozen per coordinate, its level following
the gradients as Adam's would.

A variance frozen at the end of the dense start keeps the level of the start's gradients, which are large early
in training; Adam's live variance forgets them and steps larger as the gradients shrink. Frozen, the steps stay
small: on the GPT loop without a clip (AdamW, 2-bit) the recipe ended 2-4 % above the same run with
``clip_grad_norm_(…, 1.0)``, whose clipped start froze about 2x smaller denominators, and all of the clip's gain
came back with the frozen steps times 2 and none of it from clipping after the freeze
(``experiments/results/research-clip-phase/``). :class:`LiveLevel` keeps, per param group, Adam's exponential
average of the gradients' mean square over all the group's elements,

    ``n = b2 * n + (1 - b2) * mean(g^2)``, from ``n_0 = mean((d - eps)^2)`` of the frozen denominators ``d``,

and multiplies each frozen step's gradient by ``sqrt(n_0 / n)``: where the group's gradients shrink the whole
group steps larger, as one number over the group. One number per *parameter* (1-bit LAMB's per-layer scale on
Adam's own second moment) cost 1.3 % on the same run: a parameter whose gradients shrink most gets the largest
factor, which a group's mean spreads (``experiments/results/research-live-scale/``).

``g`` is the averaged ``.grad`` the loop left (clipped, unscaled, after the spike guard): the same on every rank.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

__all__ = ["LiveLevel"]


class LiveLevel:
    """The level ``(n_0, n)`` of each param group (by its index in the optimizer), 0-d float32 tensors on the
    parameters' device (no host sync at a step)."""

    def __init__(self):
        self.levels: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def factor(self, index: int, grads: List[torch.Tensor], denoms: List[torch.Tensor], beta2: float, eps: float,
               guard: Optional[torch.Tensor] = None, norms: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Observe param group ``index``'s step and return what its frozen step multiplies the gradients by,
        ``sqrt(n_0 / n)`` after this step's ``n`` (a 0-d float32 tensor; times ``guard`` when given).

        Args:
            grads: the group's gradients with a frozen step (read only), one tensor per parameter.
            denoms: their frozen denominators, alike shaped (read only; ``n_0`` comes from them at the
                group's first call).
            beta2: the group's ``betas[1]``; eps: its ``eps``.
            guard: the spike guard's factor on ``grads`` (0-d), which the level sees as the step does.
            norms: each gradient's norm where the caller has them (float32 ``[k]``, bitwise torch's
                ``_foreach_norm``: :func:`~.step_norms.step_norms`).
        """
        elements = sum(g.numel() for g in grads)
        if norms is None:
            norms = torch.stack(torch._foreach_norm([g.float() for g in grads]))
        squares = norms.square().sum()
        if guard is not None:
            squares = squares * guard.square()
        level = self.levels.get(index)
        if level is None:
            n0 = torch.stack(torch._foreach_norm(torch._foreach_sub(denoms, eps))).square().sum() / elements
            level = (n0, n0)
        n0, n = (value.to(squares.device) for value in level)  # loaded on the CPU
        n = beta2 * n + (1 - beta2) * (squares / elements)
        self.levels[index] = (n0, n)
        # a group whose dense start saw no gradient (n_0 = 0, its denominators eps) keeps its frozen steps
        factor = torch.where(n0 > 0, n0 / n.clamp(min=torch.finfo(torch.float32).tiny), 1.0).sqrt()
        return factor if guard is None else factor * guard

    def ratio(self, index: int) -> float:
        """``n / n_0`` of param group ``index`` (1.0 before its first frozen step): what its frozen variance is
        multiplied by when the stage hands the group back to the user's Adam."""
        level = self.levels.get(index)
        return 1.0 if level is None or not float(level[0]) > 0 else float(level[1]) / float(level[0])

    def reset(self) -> None:
        """Forget every level: the next frozen step of each group starts again from its denominators."""
        self.levels = {}

    def state_dict(self) -> dict:
        """``{group index: (n_0, n)}`` as plain floats: the same on every rank."""
        return {index: (float(n0), float(n)) for index, (n0, n) in self.levels.items()}

    def prepare_load(self, state: dict, groups: int):
        """Validate :meth:`state_dict`'s output for an optimizer of ``groups`` param groups; return the function
        that assigns it. Raises ``ValueError``."""
        if not isinstance(state, dict):
            raise ValueError(f"the checkpoint's live levels are not a dict, got {type(state).__name__}")
        checked = {}
        for index, level in state.items():
            if type(index) is not int or not 0 <= index < groups or not isinstance(level, (tuple, list)) or len(
                    level) != 2 or not all(isinstance(v, float) and math.isfinite(v) and v >= 0 for v in level):
                raise ValueError(f"the checkpoint's live level {index!r}: {level!r} is not a param group's index "
                                 f"(< {groups}) with two finite floats >= 0")
            checked[index] = tuple(torch.tensor(v, dtype=torch.float32) for v in level)

        def assign() -> None:
            self.levels = checked

        return assign

    def __repr__(self) -> str:
        return f"LiveLevel({self.state_dict()})"
