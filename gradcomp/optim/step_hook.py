"""How an optimizer stage reaches the optimizer's step: a step pre-hook that knows closures.

A stage's work (the frozen-variance update, for example) must see this step's gradients. A loop
that calls ``optimizer.step()`` computed them before the call; one that calls
``optimizer.step(closure)`` (L-BFGS-style loops, Lightning's automatic optimization) computes them
inside the step, when the closure runs forward, backward and any clipping. A pre-hook that ran the
stage at once would act on the previous step's (or no) gradients there, so the closure is wrapped
and the stage runs right after it, before the optimizer's own update.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["after_closure"]


def after_closure(run: Callable[[], None]):
    """A pre-hook for ``Optimizer.register_step_pre_hook`` that calls ``run()`` on this step's gradients.

    Args:
        run: the stage's work; mutates parameters, optimizer state and ``.grad`` as the stage says.

    Returns:
        ``hook(optimizer, args, kwargs)``: without a closure it calls ``run()`` and returns None (the
        step goes on unchanged); with one (keyword or positional) it returns the step's arguments with
        the closure replaced by one that calls the user's closure, then ``run()``, and returns the loss.
    """

    def pre_hook(optimizer, args, kwargs):
        # torch hands a pre-hook the step's bound arguments: args[0] is the optimizer itself.
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            run()
            return None

        def closure_then_stage():
            loss = closure()
            run()
            return loss

        kwargs = dict(kwargs)
        kwargs["closure"] = closure_then_stage
        return args[:1], kwargs

    return pre_hook
