"""One set-up for every integration: the recipe, the checks and the engine's settings.

The DDP hook (:func:`gradcomp.hooks.ddp.register`), the Horovod optimizer, the Lightning callback and
the in-process simulation of the experiments all call :func:`prepare` with the parameters they
average and what the user passed; it applies one set of rules:

* ``compressor`` may be a spec (``"topk:0.01"``);
* ``total_steps=`` enters the one-call recipe (:mod:`gradcomp.recipe`), which reads ``optimizer=``,
  ``scheduler=`` and ``min_compression=``; a recipe argument without ``total_steps=`` is an error,
  and so is ``schedule``/``transform``/``warmup_steps`` beside the recipe (it derives them);
* an error-feedback compressor without a recipe, schedule or optimizer stage warns that it trains
  worse than dense;
* parameter names lose the prefixes wrappers add (``module.`` of DDP, ``_orig_mod.`` of
  ``torch.compile``), once, here, so that residuals, stages and checkpoints use the names of the
  model itself whatever wraps it;
* an optimizer wrapper (Accelerate's ``AcceleratedOptimizer``, which the HF ``Trainer`` also holds)
  is followed to the ``torch.optim`` optimizer inside it (:func:`innermost_optimizer`): the recipe
  reads that one's class and registers its stage as that one's step pre-hook;
* the gradient dtypes, the kernel backend and the optimizer stage's parameter names are checked
  before any step.

Decisions the user must see (the recipe's summary, a substituted compressor, a missed byte budget)
are :class:`RecipeNotice` warnings, shown once, on one rank only (``announce=False`` elsewhere), and
silenced like any warning: ``warnings.simplefilter("ignore", gradcomp.RecipeNotice)``.
"""
from __future__ import annotations

import contextvars
import functools
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

import torch

from gradcomp.compressors import Compressor, ThreeBit, TopK, TwoBit, from_spec
from gradcomp.settings import DEFAULT_MIN_NUMEL, check_backend, check_compressor, check_gradient_dtypes

__all__ = ["Setup", "prepare", "RecipeNotice", "unwrapped_names", "innermost_optimizer", "WRAPPER_PREFIXES"]

#: The prefixes wrappers add to the names of the module they hold: DDP's and ``torch.compile``'s.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: The engine settings the recipe derives itself.
RECIPE_OWNS = ("schedule", "transform", "warmup_steps")


class RecipeNotice(UserWarning):
    """A decision of gradcomp's recipe that a user should see: what it chose, a compressor it
    substituted, a byte budget it could not keep, a run longer or shorter than its plan."""


@dataclass
class Setup:
    """What :func:`prepare` decided: the compressor, the engine's keyword arguments, the recipe's
    :class:`~gradcomp.recipe.Plan` (or ``None``) and the named parameters (unwrapped names)."""

    compressor: Compressor
    settings: dict
    recipe: object = None
    named: List[Tuple[str, torch.nn.Parameter]] = field(default_factory=list)


def unwrapped_names(named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]) -> List[Tuple[str, torch.nn.Parameter]]:
    """``named_parameters`` without the wrapper prefixes that every name carries (repeatedly: a
    compiled module inside DDP has ``module._orig_mod.``), so that a wrapped and an unwrapped model
    give the same keys."""
    named = list(named_parameters)
    changed = True
    while changed and named:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if all(isinstance(name, str) and name.startswith(prefix) for name, _ in named):
                named = [(name[len(prefix):], p) for name, p in named]
                changed = True
    return named


def innermost_optimizer(optimizer):
    """The optimizer that ``optimizer`` wraps, followed through ``.optimizer`` (Accelerate's
    ``AcceleratedOptimizer``, nested ones too); ``optimizer`` itself if it wraps none.

    Why: a wrapper subclasses ``torch.optim.Optimizer`` without its ``__init__``, so its class says
    nothing of the algorithm (the recipe picks Adam's stage by class) and a step pre-hook registered
    on it never runs; its ``step()`` calls the inner optimizer's ``step()``, whose pre-hooks run.
    """
    seen = set()
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def notice(message: str, announce: bool = True) -> None:
    """Show ``message`` as a :class:`RecipeNotice` (where ``announce``: one rank speaks for all),
    attributed to the user's line.

    Inside a public entry point (:func:`speaks_to_caller`: ``register``, the Horovod optimizer, the
    framework callbacks) the notice waits for the entry point to return, which shows it as raised on the
    line that called it. Elsewhere (a notice of a training step) it names the first caller outside
    gradcomp on Python 3.12+ (``skip_file_prefixes``), and gradcomp's own calling line before.
    """
    if not announce:
        return
    held = _held_notices.get()
    if held is not None:
        held.append(f"gradcomp: {message}")
        return
    warnings.warn(f"gradcomp: {message}", RecipeNotice, **_outside_gradcomp())


#: The notices of the public entry point running now (a list), ``None`` outside one.
_held_notices: contextvars.ContextVar = contextvars.ContextVar("gradcomp_held_notices", default=None)


def speaks_to_caller(entry_point):
    """Decorate a public entry point of gradcomp: the notices decided while it runs (its set-up, the
    recipe's summary) are shown when it returns or raises, as warnings raised on the line that called it.

    Why: a warning names a source line by counting frames up from ``warnings.warn``, and gradcomp's
    depth below the user's call differs by integration; the entry point is the one frame that knows
    its caller is the user's (or the framework's) code. An entry point called inside another leaves
    the notices to the outer one.
    """

    @functools.wraps(entry_point)
    def speaking(*args, **kwargs):
        if _held_notices.get() is not None:
            return entry_point(*args, **kwargs)
        held = []
        token = _held_notices.set(held)
        try:
            return entry_point(*args, **kwargs)
        finally:
            _held_notices.reset(token)
            for message in held:
                warnings.warn(message, RecipeNotice, stacklevel=2)

    return speaking


def _outside_gradcomp() -> dict:
    """``warnings.warn``'s keyword arguments that name a line outside gradcomp where the version allows."""
    if sys.version_info < (3, 12):
        return {"stacklevel": 2}  # the caller of notice()
    import gradcomp
    import gradcomp.hooks

    return {"skip_file_prefixes": tuple(os.path.dirname(module.__file__) for module in (gradcomp, gradcomp.hooks))}


def prepare(compressor, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], *, optimizer=None,
            total_steps: Optional[int] = None, scheduler=None, min_compression: Optional[float] = None,
            stage_hook: bool = True, announce: bool = True, sharded: bool = False, **settings) -> Setup:
    """Apply the rules of the module docstring; returns the :class:`Setup` to build the engine from.

    Args:
        compressor: a compressor or its spec.
        named_parameters: ``(name, parameter)`` of the parameters the integration averages (those
            without ``requires_grad`` are left out).
        optimizer, total_steps, scheduler, min_compression: the recipe's arguments
            (:func:`gradcomp.recipe.plan`); ``total_steps`` enters it.
        stage_hook: how an optimizer stage reaches the optimizer's step (a step pre-hook; an
            integration whose ``step()`` averages first passes ``False`` and calls the stage itself).
        announce: whether this process shows the notices (one rank of the group).
        sharded: the integration shards parameters (FSDP): the recipe leaves out the stages it has not run on.
        settings: the engine's other keyword arguments (:class:`gradcomp.engine.Engine`).
    Raises:
        ValueError, TypeError: for settings that cannot work, before any step.
    """
    if isinstance(compressor, str):
        compressor = from_spec(compressor)
    compressor = check_compressor(compressor)
    named = unwrapped_names((n, p) for n, p in named_parameters if p.requires_grad)
    optimizer = innermost_optimizer(optimizer)
    if scheduler is not None and not hasattr(scheduler, "optimizer"):
        raise TypeError(f"scheduler= needs the LR scheduler itself (with .optimizer), got {type(scheduler).__name__}; "
                        "for Accelerate's prepared scheduler use gradcomp.hooks.accelerate.register")
    recipe = None
    if total_steps is not None:
        clash = sorted(set(RECIPE_OWNS) & {k for k, v in settings.items() if v is not None})
        if clash:
            raise ValueError(f"the recipe (total_steps=) derives {clash} itself; pass either the recipe's arguments "
                             "or your own schedule/transform/warmup_steps")
        from gradcomp.recipe import plan

        recipe = plan(compressor, optimizer, total_steps, scheduler, named,
                      min_numel=settings.get("min_numel", DEFAULT_MIN_NUMEL), min_compression=min_compression,
                      step_hook=stage_hook, announce=announce, sharded=sharded,
                      cast_start=settings.get("policy") is None)  # a policy times dense steps: keep them dense
        compressor = recipe.compressor
        settings.update(schedule=recipe.schedule, transform=recipe.transform)
        if recipe.granularity is not None and settings.get("granularity") is None:
            settings["granularity"] = recipe.granularity
        if recipe.residual_decay != 1.0 and settings.get("residual_decay") is None:
            settings["residual_decay"] = recipe.residual_decay
        settings.pop("warmup_steps", None)
        _fit_candidates(settings.get("policy"), recipe)
    elif optimizer is not None or scheduler is not None or min_compression is not None:
        raise ValueError("optimizer=, scheduler= and min_compression= are the recipe's; pass total_steps=<optimizer "
                         "steps in the run> with them")
    elif (compressor.uses_error_feedback and settings.get("schedule") is None
          and settings.get("transform") is None):
        notice(f"{compressor!r} with plain error feedback into your optimizer trains measurably worse than dense; "
               "pass optimizer=<your optimizer> and total_steps=<steps in the run> for the recipe that reaches "
               "dense quality", announce)
    check_gradient_dtypes([(name, p.dtype) for name, p in named], compressor)
    if named and not compressor.summable:
        check_backend(settings.get("backend"), named[0][1].device)
    _check_stage_names(settings.get("transform"), [name for name, _ in named])
    return Setup(compressor, settings, recipe, named)


def _fit_candidates(policy, recipe) -> None:
    """What a policy picks from, under the recipe: nothing the recipe's optimizer stage cannot converge
    with, where the recipe runs a 2-bit code, that code in place of the policy's own (its choice of
    ``TwoBit("chunk")`` or ``ThreeBit()`` is the recipe's for the run, and the engine's residual decay
    is set for it: a different code would run without the measured choice), and top-k as the recipe
    writes it (compact entries at twice the density, :func:`gradcomp.recipe.code`)."""
    from gradcomp.recipe import code

    if policy is None or not hasattr(policy, "candidates"):
        return
    codes, own = (TwoBit, ThreeBit), recipe.compressor
    fitted = []
    for candidate in policy.candidates:
        if recipe.unsuited and isinstance(candidate, recipe.unsuited):
            continue
        if isinstance(candidate, codes) and isinstance(own, codes):
            candidate = own
        elif isinstance(candidate, TopK):
            candidate = code(candidate)
            candidate = own if candidate.spec == own.spec else candidate
        fitted.append(candidate)
    policy.candidates = tuple(dict.fromkeys(fitted))  # the recipe's code once (compressors hash by identity)


def _check_stage_names(transform, names: List[str]) -> None:
    """An optimizer stage must know every parameter the integration averages, by these names."""
    known = transform.parameter_names() if callable(getattr(transform, "parameter_names", None)) else None
    if known is None:
        return
    missing = [name for name in names if name not in known]
    if missing:
        raise ValueError(f"the recipe's optimizer stage ({type(transform).__name__}) was built for other parameters "
                         f"than the model's: it lacks {missing[:5]}; pass the optimizer that steps this model's "
                         "parameters")
