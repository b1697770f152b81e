"""Rank workers for the one-call recipe (``gradcomp.hooks.ddp.register(..., optimizer=, total_steps=)``).

A small MLP in DDP's default buckets (one bucket holds every parameter, so per-parameter
compression inside the bucket is what runs), an LR scheduler with a linear warm-up of
``LR_WARMUP`` steps, and either the recipe or the same pieces assembled by hand from the rules of
:mod:`gradcomp.recipe` worked out in the test.
"""
import io

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.optim import DelayedMomentumSGD, FrozenVarianceAdam
from gradcomp.optim.variance_refresh import WEIGHT
from gradcomp.schedule import DenseWarmup, PlannedSchedule, SparsityRamp
from optim_workers import batch, make_model  # noqa: F401  the model and data of the optimizer-stage tests

TOTAL_STEPS = 40
LR_WARMUP = 5  # the scheduler's learning rate peaks at step 5
MIN_NUMEL = 64  # biases travel dense inside the bucket's payload
MIN_COMPRESSION = 2.0  # a loose byte budget, so that the tiny model still gets a ramp
WEIGHT_DECAY = {"sgd": 1e-3, "adamw": 0.1}


def make_optimizer(kind, model, momentum=0.9):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum, weight_decay=WEIGHT_DECAY["sgd"])
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=WEIGHT_DECAY["adamw"])


class Run:
    """One rank's DDP model, optimizer, scheduler and gradcomp state, set up ``how`` (``"recipe"``
    or ``"hand"``, the latter with ``hand`` = (dense steps, stage steps, densities))."""

    def __init__(self, kind, spec, how, hand=None):
        self.model = make_model()
        self.ddp = DDP(self.model)
        named = list(self.model.named_parameters())
        if how == "recipe":
            self.optimizer = make_optimizer(kind, self.model)
            self.scheduler = self._scheduler()
            self.state = gc_ddp.register(self.ddp, spec, optimizer=self.optimizer, total_steps=TOTAL_STEPS,
                                         scheduler=self.scheduler, min_numel=MIN_NUMEL,
                                         min_compression=MIN_COMPRESSION)
            return
        dense_steps, stage_steps, densities = hand
        compressor = gradcomp.from_spec(spec)
        if spec.startswith("twobit"):  # the recipe's 2-bit code under SGD and Adam: seven levels
            compressor = gradcomp.ThreeBit()
        elif spec.startswith("topk"):  # its top-k: twice the entries, written compact
            compressor = gradcomp.TopK(2 * compressor.density, entries="compact")
        schedule = (SparsityRamp(dense_steps, stage_steps, densities) if densities else DenseWarmup(dense_steps))
        # under Adam, the dense start's steps after the first two as an fp16 cast
        if kind == "adamw":
            schedule = PlannedSchedule(schedule, TOTAL_STEPS, announce=False, start=gradcomp.FP16())
        self.optimizer = make_optimizer(kind, self.model)
        transform = None
        if kind == "adamw":
            # a sparsifier's late gradients caught up, without the spike guard; the variance refreshed
            transform = FrozenVarianceAdam(self.optimizer, named, freeze_step=dense_steps,
                                           spike_guard=not compressor.sparsifies, refresh=WEIGHT)
        elif compressor.sparsifies:  # top-k under SGD-momentum: each coordinate's late gradient caught up
            transform = DelayedMomentumSGD(self.optimizer, named)
        self.scheduler = self._scheduler()
        # the recipe's top-k under SGD selects over the whole group
        granularity = "bucket" if kind == "sgd" and spec.startswith("topk") else "parameter"
        # and its 3-bit under SGD decays the residuals
        decay = 0.9 if kind == "sgd" and spec.startswith("twobit") else 1.0
        self.state = gc_ddp.register(self.ddp, compressor, schedule=schedule, transform=transform,
                                     min_numel=MIN_NUMEL, granularity=granularity, residual_decay=decay)

    def _scheduler(self):
        return torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (LR_WARMUP + 1)))

    def train(self, rank, start, stop):
        for step in range(start, stop):
            self.optimizer.zero_grad()
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(self.ddp(x), y).backward()
            self.optimizer.step()
            self.scheduler.step()

    def checkpoint(self) -> bytes:
        buffer = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "gradcomp": self.state.state_dict()}, buffer)
        return buffer.getvalue()

    def restore(self, blob: bytes) -> None:
        saved = torch.load(io.BytesIO(blob), weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.state.load_state_dict(saved["gradcomp"])

    def result(self):
        recipe = self.state.recipe
        return {"params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
                "step": self.state.engine.step, "stats": self.state.stats()["total"],
                "recipe": None if recipe is None else {
                    "dense_steps": recipe.dense_steps, "schedule": recipe.schedule.settings(),
                    "stage": recipe.optimizer_stage, "expected": recipe.expected_compression},
                "momentum": [g["momentum"] for g in self.optimizer.param_groups] if "momentum"
                in self.optimizer.param_groups[0] else None}


def train_worker(rank, world_size, kind, spec, how, hand=None):
    run = Run(kind, spec, how, hand)
    run.train(rank, 0, TOTAL_STEPS)
    return run.result()


def resume_worker(rank, world_size, kind, spec, split):
    """Train ``split`` steps, checkpoint, build everything afresh, restore and finish the run."""
    first = Run(kind, spec, "recipe")
    first.train(rank, 0, split)
    blob = first.checkpoint()
    second = Run(kind, spec, "recipe")
    second.restore(blob)
    second.train(rank, split, TOTAL_STEPS)
    return second.result()
