"""The tiny causal language model the HF Trainer tests train, its data, and the hand-written DDP loop
that computes what the Trainer computes (``recipe_hand_written``, a ``multiprocess.spawn`` worker).

The model is a one-layer GPT-2 built from a config (no download, no dropout, so no random numbers
during training); the data are arithmetic sequences modulo the vocabulary (a start and a stride per
sequence), which the model learns within a few steps. With ``train_sampling_strategy="sequential"``
the Trainer's data order is fixed: Accelerate shards the batches round-robin, so micro-batch ``i`` of
rank ``r`` is batch ``i * P + r`` of the dataset.
"""
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

VOCAB, LENGTH, BATCH, ACCUMULATE, STEPS, SAVE_AT = 32, 16, 4, 2, 8, 4
LR, WARMUP, CLIP, MIN_COMPRESSION, MIN_NUMEL = 3e-3, 3, 1.0, 1.5, 16


def make_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def sequences(count: int, seed: int) -> torch.Tensor:
    """``count`` arithmetic sequences modulo :data:`VOCAB`, int64 ``[count, LENGTH]``."""
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (count, 1), generator=gen)
    stride = torch.randint(1, 4, (count, 1), generator=gen)
    return (start + stride * torch.arange(LENGTH)) % VOCAB


def train_items(world_size: int):
    """The training set: exactly one epoch of the run, as the Trainer's list of examples."""
    data = sequences(STEPS * ACCUMULATE * world_size * BATCH, seed=1)
    return [{"input_ids": row, "labels": row} for row in data]


def held_out(model) -> float:
    """Mean next-token cross-entropy on 64 sequences the run never trains on."""
    data = sequences(64, seed=2)
    with torch.no_grad():
        return model(input_ids=data, labels=data).loss.item()


def result(model, state) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "held_out": held_out(model),
            "step": None if state is None else state.step,
            "dense_steps": state.recipe.dense_steps if state is not None and state.recipe else None,
            "stats": None if state is None else state.stats()["total"]}  # fmt: skip


def recipe_hand_written(rank, world_size, spec):
    """The Trainer's computation as a plain DDP loop with ``gradcomp.register``'s recipe: AdamW with
    the Trainer's defaults, the linear warm-up schedule, ``no_sync`` accumulation, the loss normalised
    by the tokens of the whole optimizer step on every rank (times the world size, as the Trainer does
    with ``average_tokens_across_devices``), clipping at ``max_grad_norm``. ``spec=None``: dense DDP."""
    from transformers import get_linear_schedule_with_warmup

    model = make_model()
    ddp = DDP(model)
    # The Trainer's default optim on torch >= 2.8 is "adamw_torch_fused" (the test compares the defaults).
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  fused=True)  # fmt: skip
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, STEPS)
    state = None if spec is None else gradcomp.register(
        ddp, spec, optimizer=optimizer, scheduler=scheduler, total_steps=STEPS, min_compression=MIN_COMPRESSION,
        min_numel=MIN_NUMEL, backend="torch")  # fmt: skip
    data = torch.stack([item["input_ids"] for item in train_items(world_size)])
    tokens = torch.tensor(ACCUMULATE * world_size * BATCH * (LENGTH - 1))
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            index = (step * ACCUMULATE + micro) * world_size + rank
            x = data[index * BATCH:(index + 1) * BATCH]
            with ddp.no_sync() if micro < ACCUMULATE - 1 else contextlib.nullcontext():
                loss = ddp(input_ids=x, labels=x, num_items_in_batch=tokens).loss
                loss *= world_size
                loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        optimizer.step()
        scheduler.step()
        ddp.zero_grad()
    return {**result(model, state), "optimizer_groups": group_settings(optimizer)}


def group_settings(optimizer) -> set:
    """The distinct settings of ``optimizer``'s param groups (lr aside: the schedule sets it)."""
    keys = ("betas", "eps", "weight_decay", "amsgrad", "fused", "foreach", "decoupled_weight_decay")
    return {tuple((key, group.get(key)) for key in keys) for group in optimizer.param_groups}
