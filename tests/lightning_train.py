"""Train the ``ddp_workers`` MLP with Lightning on 2 CPU ranks and gradcomp's callback.

Run as a script (Lightning's ``ddp`` launcher re-executes it once per extra rank)::

    python tests/lightning_train.py SPEC STEPS OUT [--resume CKPT] [--save CKPT]

Every step ``s`` of rank ``r`` trains on ``ddp_workers.batch(r, s)``: the data depends only on the
global step, so a resumed run sees exactly what an uninterrupted one sees. Rank 0 writes the final
parameters, held-out loss and gradcomp stats to ``OUT`` (``torch.save``).
"""
import os
import sys

import lightning.pytorch as pl
import torch

import ddp_workers as workers  # tests/ is on PYTHONPATH (see test_frameworks.run_lightning)
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


def held_out_loss(net):
    x, y = workers.batch(99, 999, n=256)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(net(x), y).item()


def main(argv):
    spec, steps, out = argv[0], int(argv[1]), argv[2]
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else None
    save = argv[argv.index("--save") + 1] if "--save" in argv else None
    torch.set_num_threads(1)
    name, _, arg = spec.partition(":")
    callback = GradcompCallback(workers.make_compressor((name, float(arg) if arg else None)), warmup_steps=1,
                                min_numel=16, backend="torch")  # fmt: skip
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, callbacks=[callback],
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, logger=pl.loggers.CSVLogger(os.path.dirname(out)),
                         log_every_n_steps=1)  # fmt: skip
    module = Regression()
    trainer.fit(module, ckpt_path=resume)
    if save:
        trainer.save_checkpoint(save)
    if trainer.global_rank == 0:
        torch.save({"params": {n: p.detach().clone() for n, p in module.net.named_parameters()},
                    "held_out": held_out_loss(module.net), "stats": callback.state.stats(),
                    "step": callback.state.step,
                    "logged": {k: float(v) for k, v in trainer.callback_metrics.items()}}, out)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
