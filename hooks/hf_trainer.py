"""Hugging Face ``Trainer`` adapter: a ``TrainerCallback`` that puts gradcomp's DDP hook on the model the
Trainer wraps, with the Trainer's own optimizer, LR scheduler and step count, and keeps gradcomp's
state in the Trainer's checkpoints.

The Trainer builds its ``DistributedDataParallel`` model, its optimizer and its scheduler inside
``train()`` (through Accelerate) and hands callbacks only the unwrapped model, so the callback holds
the trainer and registers in ``on_train_begin``, after all three exist and a resumed run has loaded
its optimizer and scheduler, before the first backward. What it translates:

* the optimizer: ``trainer.optimizer`` is Accelerate's ``AcceleratedOptimizer``; the recipe reads the
  ``torch.optim`` optimizer inside it (:func:`gradcomp.setup.innermost_optimizer`), whose ``step()``
  the Trainer calls once per optimizer step, after ``max_grad_norm`` clipping of the average gradient;
* the scheduler and the run's length: ``trainer.lr_scheduler`` steps once per optimizer step; the
  recipe's ``total_steps`` is ``state.max_steps``;
* ``gradient_accumulation_steps``: the Trainer runs the forward and backward of every micro-batch but
  the last under DDP's ``no_sync``, so the hook runs once per optimizer step and residuals stay as they
  are in between;
* checkpoints: in ``on_save`` (every rank) every rank's state is gathered and rank 0 writes it as
  :data:`CHECKPOINT_FILE` into the checkpoint folder (``output_dir/checkpoint-N``); on a resumed run
  each rank restores its own part from the checkpoint the Trainer resumed from (see
  :meth:`GradcompTrainerCallback.checkpoint_dir`).

Example::

    >>> from gradcomp.hooks.hf_trainer import GradcompTrainerCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=train)
    >>> trainer.add_callback(GradcompTrainerCallback(trainer, "topk:0.01"))
    >>> trainer.train()

``transformers`` is imported here only; ``import gradcomp`` never needs it.
"""
import os
import warnings
from typing import Optional

import torch

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError("gradcomp.hooks.hf_trainer needs transformers: pip install transformers") from error

from gradcomp.hooks import ddp as gc_ddp
from gradcomp.hooks.accelerate import OptimizerStepScheduler
from gradcomp.setup import innermost_optimizer, speaks_to_caller

__all__ = ["GradcompTrainerCallback", "CHECKPOINT_FILE"]

#: The file in a Trainer checkpoint folder that holds every rank's gradcomp state.
CHECKPOINT_FILE = "gradcomp.pt"


class GradcompTrainerCallback(TrainerCallback):
    """Register :func:`gradcomp.hooks.ddp.compression_hook` on the Trainer's DDP model.

    Args:
        trainer: the ``transformers.Trainer`` this callback is added to (read, not changed).
        compressor: a :class:`gradcomp.Compressor` or its spec (``"topk:0.01"``).
        recipe: pass the Trainer's optimizer, LR scheduler and ``state.max_steps`` to the one-call
            recipe (default); ``False``: plain error feedback, or your own ``schedule=``.
        resume_from: a checkpoint folder to restore gradcomp's state from, for a resume from a folder
            that :meth:`checkpoint_dir` does not find.
        register_kwargs: passed to :func:`gradcomp.hooks.ddp.register` unchanged.

    Attributes:
        state: the :class:`gradcomp.hooks.ddp.CompressionState`, set in ``on_train_begin``.
    """

    def __init__(self, trainer, compressor, recipe: bool = True, resume_from: Optional[str] = None,
                 **register_kwargs):
        self.trainer, self.compressor, self.recipe = trainer, compressor, recipe
        self.resume_from, self.register_kwargs = resume_from, register_kwargs
        self.state: Optional[gc_ddp.CompressionState] = None
        self._ddp = None

    @speaks_to_caller
    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if self.state is not None and model is self._ddp:
            return  # a second train() on the same DDP model: its hook is in place
        if not isinstance(getattr(model, "_orig_mod", model), torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradcompTrainerCallback needs the Trainer's DistributedDataParallel model (launch with "
                            f"torchrun or accelerate launch on several processes, without FSDP or DeepSpeed); "
                            f"the Trainer's model is a {type(model).__name__}")
        register_kwargs = dict(self.register_kwargs)
        if self.recipe:
            optimizer = innermost_optimizer(self.trainer.optimizer)
            scheduler = self.trainer.lr_scheduler  # stepped once per optimizer step
            if scheduler is not None:
                scheduler = OptimizerStepScheduler(scheduler, optimizer)
            register_kwargs.update(optimizer=optimizer, total_steps=int(state.max_steps), scheduler=scheduler)
        self.state, self._ddp = gc_ddp.register(model, self.compressor, **register_kwargs), model
        if state.global_step > 0:
            self._restore(self.checkpoint_dir(args, state))

    def checkpoint_dir(self, args, state) -> Optional[str]:
        """The folder a resumed run (``state.global_step > 0``) continues from: ``resume_from``, else
        ``args.resume_from_checkpoint`` (the HF example scripts pass it to ``train()``), else
        ``output_dir/checkpoint-<global_step>`` (``train(resume_from_checkpoint=True)``); the first that
        holds :data:`CHECKPOINT_FILE`, or ``None``."""
        step_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        for folder in (self.resume_from, args.resume_from_checkpoint, step_dir):
            if isinstance(folder, str) and os.path.isfile(os.path.join(folder, CHECKPOINT_FILE)):
                return folder
        return None

    def _restore(self, folder: Optional[str]) -> None:
        if folder is None:
            warnings.warn("gradcomp: the Trainer resumed at a step > 0 but no checkpoint folder with "
                          f"{CHECKPOINT_FILE} was found (pass GradcompTrainerCallback(..., resume_from=<folder>)); "
                          "residuals start at zero", stacklevel=2)
            return
        saved = torch.load(os.path.join(folder, CHECKPOINT_FILE), map_location="cpu", weights_only=True)
        self.state.load_state_dict(saved)

    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        everyone = self.state.full_state_dict()  # a collective: the Trainer calls on_save on every rank
        if args.should_save:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            torch.save(everyone, os.path.join(folder, CHECKPOINT_FILE))
