"""The recipe run of ``framework_workers.recipe_hand_written``, written as an Accelerate script.

Run under ``accelerate launch`` (2 CPU processes over Gloo; see test_frameworks.run_accelerate)::

    accelerate launch ... tests/accelerate_train.py SPEC STEPS ACCUMULATE OUT [--save-at K DIR] [--resume DIR K]

What an ``accelerate launch`` user writes: ``prepare``, then ``gradcomp.hooks.accelerate.register`` on
what it returned; ``accelerator.accumulate``, ``accelerator.backward``, ``accelerator.clip_grad_norm_``;
``save_state`` / ``load_state`` for checkpoints. Micro-batch ``i`` of rank ``r`` is
``ddp_workers.batch(r, i)``, so a resumed run sees what an uninterrupted one sees. Rank 0 writes the
result (``framework_workers.result``) and, per micro-batch, whether it synchronised, the hook's step
and whether gradcomp's state changed.
"""
import sys

import torch
from accelerate import Accelerator

import ddp_workers as workers  # tests/ is on PYTHONPATH (see test_frameworks.run_accelerate)
import framework_workers as fw
from gradcomp.hooks import accelerate as gc_accelerate


def main(argv):
    spec, steps, accumulate, out = argv[0], int(argv[1]), int(argv[2]), argv[3]
    save_at, save_dir = (int(argv[argv.index("--save-at") + 1]), argv[argv.index("--save-at") + 2]) \
        if "--save-at" in argv else (None, None)
    resume, start = (argv[argv.index("--resume") + 1], int(argv[argv.index("--resume") + 2])) \
        if "--resume" in argv else (None, 0)
    torch.set_num_threads(1)
    # cpu=True: on a machine without accelerators `accelerate launch` starts the ranks; they use Gloo.
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    world = accelerator.num_processes
    model = workers.make_model("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=fw.RECIPE_LR)
    # The prepared scheduler steps `world` times per optimizer step: the warm-up is written in those steps.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: fw.warmup(s // world))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    state = gc_accelerate.register(accelerator, model, spec, optimizer=optimizer, scheduler=scheduler,
                                   **fw.recipe_kwargs(steps))  # fmt: skip
    if resume:
        accelerator.load_state(resume)
    records = []
    for step in range(start, steps):
        for micro in range(accumulate):
            before = fw.snapshot(state)
            with accelerator.accumulate(model):
                x, y = workers.batch(accelerator.process_index, step * accumulate + micro)
                accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), fw.CLIP)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            records.append({"synced": accelerator.sync_gradients, "engine_step": state.step,
                            "unchanged": fw.same(before, fw.snapshot(state))})  # fmt: skip
        if step + 1 == save_at:
            accelerator.save_state(save_dir)
    outcome = fw.result(accelerator.unwrap_model(model), state)
    if accelerator.is_main_process:
        torch.save({**outcome, "records": records, "world": world}, out)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1:])
