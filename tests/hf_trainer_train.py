"""Train ``hf_workers``' tiny GPT-2 with the HF ``Trainer`` on 2 CPU ranks (``torchrun``), with gradcomp's
callback and the Trainer's own optimizer, scheduler, clipping and accumulation::

    torchrun --nproc_per_node 2 tests/hf_trainer_train.py SPEC|dense OUT_DIR RESULT [--resume CHECKPOINT]

Checkpoints go to ``OUT_DIR/checkpoint-<step>`` every ``hf_workers.SAVE_AT`` steps; ``--resume`` sets
``TrainingArguments(resume_from_checkpoint=...)`` and passes it to ``train()``, as the HF example
scripts do. Rank 0 writes the result (``hf_workers.result``) and what the Trainer built.
"""
import sys

import torch
from transformers import Trainer, TrainingArguments

import hf_workers as hf  # tests/ is on PYTHONPATH (see launchers.environment)
from gradcomp import inflight
from gradcomp.hooks.hf_trainer import GradcompTrainerCallback
from gradcomp.setup import innermost_optimizer


def main(argv):
    spec, out_dir, result_path = argv[0], argv[1], argv[2]
    resume = argv[argv.index("--resume") + 1] if "--resume" in argv else None
    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=hf.BATCH,
        gradient_accumulation_steps=hf.ACCUMULATE,
        max_steps=hf.STEPS, learning_rate=hf.LR, warmup_steps=hf.WARMUP, lr_scheduler_type="linear",
        max_grad_norm=hf.CLIP, train_sampling_strategy="sequential", save_strategy="steps", save_steps=hf.SAVE_AT,
        logging_steps=1, report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        resume_from_checkpoint=resume,
    )  # fmt: skip
    trainer = Trainer(model=hf.make_model(), args=args, train_dataset=hf.train_items(args.world_size))
    callback = None
    if spec != "dense":
        callback = GradcompTrainerCallback(trainer, spec, min_compression=hf.MIN_COMPRESSION, min_numel=hf.MIN_NUMEL,
                                           backend="torch")  # fmt: skip
        trainer.add_callback(callback)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if trainer.is_world_process_zero():
        outcome = hf.result(trainer.model, None if callback is None else callback.state)
        optimizer = innermost_optimizer(trainer.optimizer)
        outcome.update(world=args.world_size, accepts_loss_kwargs=trainer.model_accepts_loss_kwargs,
                       optimizer_class=type(optimizer).__name__, optimizer_groups=hf.group_settings(optimizer),
                       mixed_precision=trainer.accelerator.mixed_precision,
                       ddp=type(trainer.model_wrapped).__name__)  # fmt: skip
        torch.save(outcome, result_path)
    # The dense baseline starts no collective of gradcomp's, so gradcomp's exit wait is never installed there, and the
    # Trainer's own last gather hands Gloo Python tensors that its thread frees after wait() returns: a dense rank
    # aborted at exit once in a whole-suite run ("terminate called without an active exception"). Wait as gradcomp's
    # exit waits (gradcomp.inflight's docstring).
    inflight.wait_for_idle_gloo_threads()


if __name__ == "__main__":
    main(sys.argv[1:])
