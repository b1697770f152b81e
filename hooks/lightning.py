"""PyTorch Lightning adapter: a ``Callback`` that puts gradcomp's DDP hook on the model Lightning wraps.

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` takes a state built before
the model exists, but gradcomp's state needs the wrapped module's named parameters (residuals are
keyed by name so they survive a restart). The callback therefore registers in ``on_fit_start``,
after the strategy has built the ``DistributedDataParallel`` model and before the first backward.

Example::

    >>> from gradcomp.hooks.lightning import GradcompCallback
    >>> trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
    ...                   callbacks=[GradcompCallback(gradcomp.TopK(0.01))])

Checkpoints: residuals are per rank, and Lightning writes one file from rank 0. ``on_save_checkpoint``
(which Lightning calls on every rank) gathers each rank's :meth:`CompressionState.state_dict` into
``checkpoint["gradcomp"] = {"world_size": P, "ranks": [state_0, ..., state_{P-1}]}``; on resume
every rank reads the file and restores the entry with its own rank. A checkpoint of another world
size is left to :meth:`CompressionState.load_state_dict` (it warns and starts from zero residuals).

Lightning is imported here only; ``import gradcomp`` never needs it.
"""
import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as error:  # pragma: no cover - exercised only without lightning
    raise ImportError(
        "gradcomp.hooks.lightning needs PyTorch Lightning: pip install 'gradcomp[frameworks]' "
        "(or pip install 'lightning==2.6.*')"
    ) from error

from gradcomp import inflight
from gradcomp.compressors.base import Compressor
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.setup import speaks_to_caller

__all__ = ["GradcompCallback", "CHECKPOINT_KEY"]

logger = logging.getLogger(__name__)

CHECKPOINT_KEY = "gradcomp"


class GradcompCallback(Callback):
    """Register :func:`gradcomp.hooks.ddp.compression_hook` on Lightning's DDP model.

    Args:
        compressor: a :class:`gradcomp.Compressor`.
        recipe: also pass ``optimizer=`` (the first optimizer from ``configure_optimizers``),
            ``total_steps=trainer.estimated_stepping_batches`` and, for a per-step LR scheduler,
            ``scheduler=`` to :func:`gradcomp.hooks.ddp.register` (the one-call recipe).
        log_stats: log ``gradcomp/compression_ratio`` and ``gradcomp/bytes_sent`` (of the last
            step) through the LightningModule's logger after each optimizer step.
        **register_kwargs: passed to :func:`gradcomp.hooks.ddp.register` unchanged
            (``warmup_steps``, ``min_numel``, ``backend``, ...).

    Attributes:
        state: the :class:`gradcomp.hooks.ddp.CompressionState`, set in ``on_fit_start``.
    """

    def __init__(self, compressor: Compressor, recipe: bool = False, log_stats: bool = True, **register_kwargs):
        self.compressor = compressor
        self.recipe = recipe
        self.log_stats = log_stats
        self.register_kwargs = register_kwargs
        self.state: Optional[gc_ddp.CompressionState] = None
        self._pending: Optional[Dict[str, Any]] = None  # this rank's state read from a checkpoint

    @speaks_to_caller
    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(
                f"GradcompCallback needs a DDP strategy (strategy='ddp' or DDPStrategy(...)); "
                f"Lightning's model is a {type(model).__name__}"
            )
        kwargs = dict(self.register_kwargs)
        if self.recipe:
            steps = trainer.estimated_stepping_batches
            if not steps < float("inf"):
                raise ValueError("GradcompCallback(recipe=True) needs a bounded run: set Trainer(max_steps=...) "
                                 "or max_epochs")
            # Lightning steps with a closure that runs forward, backward and clipping inside
            # optimizer.step(); the stage's step pre-hook runs after it (gradcomp.optim.step_hook).
            kwargs["optimizer"], kwargs["total_steps"] = trainer.optimizers[0], int(steps)
            configs = [c for c in trainer.lr_scheduler_configs if c.interval == "step"]
            if configs:  # the recipe's dense start follows the warm-up of a per-step schedule
                kwargs["scheduler"] = configs[0].scheduler
        self.state = gc_ddp.register(model, self.compressor, **kwargs)
        if self._pending is not None:
            self.state.load_state_dict(self._pending)
            self._pending = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.log_stats or self.state is None:
            return
        last = self.state.stats()["last_step"]
        ratio = last["compression_ratio"]
        pl_module.log_dict(
            {"gradcomp/compression_ratio": float(ratio) if ratio == ratio else 1.0,
             "gradcomp/bytes_sent": float(last["bytes_sent"])},
            on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=False,
        )  # fmt: skip

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        if self.state is None:
            return
        mine = self.state.state_dict()
        if dist.is_available() and dist.is_initialized():
            # Every rank runs dump_checkpoint, so this collective is matched on all ranks; the gather
            # holds its tensors until Gloo lets go (a checkpoint is often the run's last collective).
            everyone = inflight.all_gather_object(mine)
        else:
            everyone = [mine]
        checkpoint[CHECKPOINT_KEY] = {"world_size": len(everyone), "ranks": everyone}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            return
        rank = trainer.global_rank
        if rank >= len(saved["ranks"]):
            logger.warning("gradcomp: the checkpoint holds %d ranks' states, none for rank %d; residuals start at zero",
                           len(saved["ranks"]), rank)  # fmt: skip
            return
        # Lightning restores callbacks before the strategy wraps the model: keep it for on_fit_start.
        self._pending = saved["ranks"][rank]
        if self.state is not None:
            self.state.load_state_dict(self._pending)
            self._pending = None
