"""Train the ``ddp_workers`` MLP with Lightning on 2 CPU ranks and gradcomp's callback.

Run as a script (Lightning's ``ddp`` launcher re-executes it once per extra rank)::

    python tests/lightning_train.py SPEC STEPS OUT [--resume CKPT] [--save CKPT] [--save-at K CKPT] [--recipe]

Every step ``s`` of rank ``r`` trains on ``ddp_workers.batch(r, s)``: the data depends only on the
global step, so a resumed run sees exactly what an uninterrupted one sees. Rank 0 writes the final
parameters, held-out loss and gradcomp stats to ``OUT`` (``torch.save``).

``--recipe``: the run of ``framework_workers.recipe_hand_written`` in Lightning's words -- AdamW and a
per-step LR warm-up from ``configure_optimizers``, ``gradient_clip_val``, ``accumulate_grad_batches``
and ``GradcompCallback(recipe=True)``; micro-batch ``i`` of rank ``r`` is ``ddp_workers.batch(r, i)``.
"""
import os
import sys

import lightning.pytorch as pl
import torch

import ddp_workers as workers  # tests/ is on PYTHONPATH (see test_frameworks.run_lightning)
import framework_workers as fw
from gradcomp.hooks.lightning import GradcompCallback

LR, MOMENTUM, STEPS_PER_EPOCH = 0.05, 0.9, 4


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = workers.make_model("mlp")

    def training_step(self, batch, batch_idx):
        x, y = workers.batch(self.global_rank, self.global_step)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)

    def train_dataloader(self):
        # The items are ignored: training_step draws the batch from the global step.
        return torch.utils.data.DataLoader(list(range(STEPS_PER_EPOCH)), batch_size=None)


class RecipeRegression(Regression):
    """The recipe run: AdamW under a per-step warm-up; the batch from the micro-batch's index."""

    def training_step(self, batch, batch_idx):
        micro = self.global_step * fw.ACCUMULATE + batch_idx % fw.ACCUMULATE
        x, y = workers.batch(self.global_rank, micro)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=fw.RECIPE_LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fw.warmup)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SaveAt(pl.Callback):
    """``trainer.save_checkpoint(path)`` once, after optimizer step ``step`` (on every rank, as Lightning's
    own checkpointing does: gradcomp's callback gathers every rank's state there)."""

    def __init__(self, step, path):
        self.step, self.path, self.done = step, path, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            trainer.save_checkpoint(self.path)
            self.done = True


def held_out_loss(net):
    x, y = workers.batch(99, 999, n=256)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x), y).item()


def main(argv):
    spec, steps, out = argv[0], int(argv[1]), argv[2]
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else None
    save = argv[argv.index("--save") + 1] if "--save" in argv else None
    torch.set_num_threads(1)
    recipe = "--recipe" in argv
    if recipe:
        callback = GradcompCallback(spec, recipe=True, **{k: v for k, v in fw.recipe_kwargs(steps).items()
                                                         if k != "total_steps"})  # fmt: skip
        fitting = {"gradient_clip_val": fw.CLIP, "accumulate_grad_batches": fw.ACCUMULATE}
    else:
        name, _, arg = spec.partition(":")
        callback = GradcompCallback(workers.make_compressor((name, float(arg) if arg else None)), warmup_steps=1,
                                    min_numel=16, backend="torch")  # fmt: skip
        fitting = {}
    callbacks = [callback]
    if "--save-at" in argv:
        where = argv.index("--save-at")
        callbacks.append(SaveAt(int(argv[where + 1]), argv[where + 2]))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, callbacks=callbacks,
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, logger=pl.loggers.CSVLogger(os.path.dirname(out)),
                         log_every_n_steps=1, **fitting)  # fmt: skip
    module = RecipeRegression() if recipe else Regression()
    trainer.fit(module, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    if trainer.global_rank == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
                    "held_out": held_out_loss(module.net), "stats": callback.state.stats(),
                    "step": callback.state.step, "dense_steps": getattr(callback.state.recipe, "dense_steps", None),
                    "logged": {k: float(v) for k, v in trainer.callback_metrics.items()}}, out)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
