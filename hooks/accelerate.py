"""Accelerate adapter: gradcomp's DDP hook on the model ``accelerator.prepare`` returns, and its state
in ``accelerator.save_state`` / ``load_state``.

Accelerate wraps the model in ``DistributedDataParallel`` for every multi-process run (CPU over Gloo,
GPUs over NCCL), but its ``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's own hooks
by name; gradcomp's hook therefore goes on the prepared model, after ``prepare``. What this module
translates:

* **the optimizer**: ``prepare`` returns an ``AcceleratedOptimizer``; the recipe reads the
  ``torch.optim`` optimizer inside it (:func:`gradcomp.setup.innermost_optimizer`), whose ``step()``
  the wrapper calls only on the steps that synchronise, so the recipe's stage (a step pre-hook on
  that optimizer) runs once per optimizer step;
* **the LR scheduler**: an ``AcceleratedScheduler`` steps the scheduler it holds ``num_processes``
  times per optimizer step (unless ``split_batches``); the recipe reads the LR warm-up in optimizer
  steps, through :class:`OptimizerStepScheduler`, which steps a copy as often;
* **checkpoints**: residuals differ per rank, and ``save_state`` writes registered objects from the
  main process only; the object :func:`register` hands to ``accelerator.register_for_checkpointing``
  (:class:`AllRanksState`) saves every rank's state in one dict (a collective: ``save_state`` runs on
  every rank) and each rank loads its own part;
* **accumulation**: ``accelerator.accumulate(model)`` runs the forward and the backward of an
  accumulation step under DDP's ``no_sync``: the hook is not called, residuals stay as they are, and
  the hook's step counts optimizer steps. Clipping with ``accelerator.clip_grad_norm_`` between
  ``backward`` and ``step`` acts on the average gradient, as with dense DDP.

Example::

    >>> from gradcomp.hooks import accelerate as gc_accelerate
    >>> model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    >>> state = gc_accelerate.register(accelerator, model, "topk:0.01", optimizer=optimizer,
    ...                                total_steps=steps, scheduler=scheduler)

Accelerate is imported by the caller, never here: ``import gradcomp`` does not need it.
"""
import copy
from typing import Optional

import torch

from gradcomp.hooks import ddp as gc_ddp
from gradcomp.lr_schedule import rewind
from gradcomp.setup import innermost_optimizer, speaks_to_caller

__all__ = ["register", "AllRanksState", "OptimizerStepScheduler"]


class AllRanksState:
    """What :func:`register` gives ``accelerator.register_for_checkpointing``: ``state_dict()`` is
    :meth:`~gradcomp.hooks.ddp.CompressionState.full_state_dict` (every rank's state; a collective,
    called on every rank), ``load_state_dict()`` restores this rank's part into ``state`` (mutated)."""

    def __init__(self, state: gc_ddp.CompressionState):
        self.state = state

    def state_dict(self) -> dict:
        return self.state.full_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"AllRanksState({self.state.engine.compressor!r})"


class OptimizerStepScheduler:
    """An LR scheduler seen per optimizer step and from the run's first step, for the recipe's reading
    of its warm-up.

    Args:
        scheduler: the ``torch.optim.lr_scheduler`` object (never stepped or changed here).
        optimizer: the ``torch.optim`` optimizer it drives (not a wrapper).
        per_step: how many times the loop steps ``scheduler`` per optimizer step.

    The recipe steps a deep copy (:func:`gradcomp.recipe.lr_peak_step`). The copy is of ``scheduler``
    with ``optimizer`` in place of whatever wrapper it holds (a wrapper carries the launcher's process
    state, which is neither copyable nor needed to compute a learning rate), rewound to the run's
    first step: a resumed run has loaded the scheduler's state before it registers, and its plan must
    be the one its checkpoint was saved under. The rewind is exact for the schedulers whose rate is a
    function of the step (``LambdaLR``, which every HF ``get_scheduler`` type is, ``LinearLR``, ...).
    """

    def __init__(self, scheduler, optimizer, per_step: int = 1):
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1, got {per_step}")
        self.scheduler, self.optimizer, self.per_step = scheduler, optimizer, int(per_step)

    def step(self) -> None:
        for _ in range(self.per_step):
            self.scheduler.step()

    def __deepcopy__(self, memo):
        view = copy.copy(self.scheduler)
        view.optimizer = self.optimizer
        inner = copy.deepcopy(view, memo)
        rewind(inner)
        return OptimizerStepScheduler(inner, inner.optimizer, self.per_step)

    def __repr__(self) -> str:
        return f"OptimizerStepScheduler({type(self.scheduler).__name__}, per_step={self.per_step})"


def per_optimizer_step(accelerator, scheduler) -> Optional[OptimizerStepScheduler]:
    """``scheduler`` (prepared or not) as :class:`OptimizerStepScheduler`; ``None`` stays ``None``."""
    if scheduler is None:
        return None
    inner = getattr(scheduler, "scheduler", scheduler)
    per_step = 1
    if inner is not scheduler:  # an AcceleratedScheduler: it decides how often the inner one steps
        if not scheduler.step_with_optimizer:
            per_step = accelerator.gradient_accumulation_steps  # stepped by the loop, every micro-batch
        elif not scheduler.split_batches:
            per_step = accelerator.num_processes
    return OptimizerStepScheduler(inner, innermost_optimizer(inner.optimizer), per_step)


@speaks_to_caller
def register(accelerator, model: torch.nn.Module, compressor, *, optimizer=None, total_steps: Optional[int] = None,
             scheduler=None, checkpoint: bool = True, **register_kwargs) -> gc_ddp.CompressionState:
    """Put gradcomp's hook on ``model`` (what ``accelerator.prepare`` returned) and return the state.

    Args:
        accelerator: the run's ``accelerate.Accelerator`` (mutated: with ``checkpoint``, an
            :class:`AllRanksState` is registered for checkpointing).
        model: the prepared model: ``DistributedDataParallel``, or ``torch.compile`` of one.
        compressor: a :class:`gradcomp.Compressor` or its spec (``"topk:0.01"``).
        optimizer, scheduler: the prepared optimizer and LR scheduler (or the ones given to
            ``prepare``); the recipe reads the ``torch.optim`` objects inside them.
        total_steps: optimizer steps in the run (with ``gradient_accumulation_steps=g``: the number of
            batches / g); enters the one-call recipe, as in :func:`gradcomp.hooks.ddp.register`.
        checkpoint: have ``accelerator.save_state`` save every rank's gradcomp state and
            ``load_state`` restore it. Register before ``load_state``: Accelerate restores registered
            objects in the order they were registered.
        register_kwargs: the rest of :func:`gradcomp.hooks.ddp.register`'s arguments.
    Raises:
        TypeError: when Accelerate did not wrap ``model`` in DDP (one process, FSDP, DeepSpeed).
    """
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"gradcomp needs the DistributedDataParallel model that accelerator.prepare returns in a "
                        f"multi-process run; got {type(model).__name__} (distributed_type="
                        f"{accelerator.distributed_type}): launch with several processes and without FSDP or "
                        "DeepSpeed, and pass the prepared model")
    state = gc_ddp.register(model, compressor, optimizer=optimizer, total_steps=total_steps,
                            scheduler=per_optimizer_step(accelerator, scheduler), **register_kwargs)
    if checkpoint:
        accelerator.register_for_checkpointing(AllRanksState(state))
    return state
