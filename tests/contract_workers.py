"""The patterns of real training loops, run on real DDP ranks and on the in-process simulation.

One loop (:func:`train`) holds every pattern the ``.grad`` contract must survive: a learning rate
set by hand in ``param_groups`` each step (or an LR scheduler), two param groups with different
weight decay, gradient accumulation with ``no_sync``, ``GradScaler.unscale_`` then
``clip_grad_norm_`` or ``clip_grad_value_``, gradient-norm logging, ``zero_grad(set_to_none=True)``.
:func:`ddp_worker` runs it on a rank of a real Gloo group with ``gradcomp.register``;
:func:`simulated` runs the same loop on ``experiments.simulate`` for every rank at once.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp

WIDTH, CLASSES = 48, 10


def make_model(seed: int = 0) -> torch.nn.Module:
    """An MLP whose weight matrices (>= 1024 elements) are compressed and whose biases travel dense."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, CLASSES))


def batch(rank: int, step: int, size: int = 16):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 24, generator=generator)
    return x, (x[:, :CLASSES].argmax(1) + step) % CLASSES


def lr_at(config: dict, step: int) -> float:
    warmup = config.get("warmup", 4)
    peak = config["lr"]
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, config["steps"] - warmup))))


def build_optimizer(config: dict, model):
    """Two param groups (weight decay on matrices only); SGD with momentum or AdamW."""
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": config["weight_decay"]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    if config["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=config["lr"], betas=(0.9, 0.95))
    else:
        optimizer = torch.optim.SGD(groups, lr=config["lr"], momentum=0.9)
    scheduler = None
    if not config.get("manual_lr", True):
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_at(config, s) / config["lr"])
    return optimizer, scheduler


def loss_fn(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y)


def clip(config: dict, model, optimizer, scaler):
    """Unscale, then clip as the config says; the gradient norm the loop would log."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if config.get("clip_value"):
        torch.nn.utils.clip_grad_value_(model.parameters(), config["clip_value"])
    if config.get("clip"):
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"]))
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))


def step(config: dict, optimizer, scheduler, scaler):
    """The optimizer's step (unless ``config["skip_step"]``: the loop stepped already), the
    scheduler's, ``zero_grad(set_to_none=True)``."""
    if config.get("skip_step"):
        pass
    elif scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def make_scaler(config: dict):
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) if config.get("scaler") else None


class Rank:
    """One real DDP rank of the loop: model, optimizer, scheduler, scaler and gradcomp's state."""

    def __init__(self, rank: int, config: dict):
        self.rank, self.config = rank, config
        self.model = make_model()
        self.ddp = DDP(self.model)
        self.optimizer, self.scheduler = build_optimizer(config, self.model)
        self.scaler = make_scaler(config)
        self.state = None
        if config.get("spec"):
            self.state = gradcomp.register(self.ddp, config["spec"], optimizer=self.optimizer,
                                           total_steps=config["steps"], scheduler=self.scheduler,
                                           min_compression=config.get("min_compression", 2.0),
                                           grad_scaler=self.scaler, min_numel=256)
        self.log = {"norms": [], "grads": []}

    def train(self, start: int, stop: int) -> None:
        """Steps ``start`` to ``stop``; ``config["closure"]``: backward and clipping inside
        ``optimizer.step(closure)``, as L-BFGS-style loops and Lightning do."""
        config = self.config
        for s in range(start, stop):
            if self.scheduler is None:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(config, s)
            if config.get("closure"):
                self.optimizer.step(lambda: self.backward_and_clip(s))
                step({**config, "skip_step": True}, self.optimizer, self.scheduler, self.scaler)
            else:
                self.backward_and_clip(s)
                step(config, self.optimizer, self.scheduler, self.scaler)

    def backward_and_clip(self, s: int) -> torch.Tensor:
        micro = self.config.get("accumulation", 1)
        for m in range(micro):
            context = self.ddp.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with context:
                loss = loss_fn(self.ddp, *batch(self.rank, s * micro + m)) / micro
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.log["grads"].append(self.model[2].weight.grad.clone())
        self.log["norms"].append(clip(self.config, self.model, self.optimizer, self.scaler))
        return loss.detach()

    def checkpoint(self) -> dict:
        """One dict for the whole job (rank 0 saves it): gradcomp's part holds every rank's state."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "gradcomp": self.state.full_state_dict()}

    def restore(self, saved: dict) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
        self.state.load_state_dict(saved["gradcomp"])

    def result(self) -> dict:
        return {**self.log, "params": [p.detach().clone() for p in self.model.parameters()],
                "stats": self.state.stats()["total"] if self.state is not None else None,
                "opened": freeze_opened(self.state.engine if self.state is not None else None)}


def freeze_opened(engine):
    """The step the Adam stage's variance froze at (``None``: no Adam stage, or not frozen yet)."""
    gate = getattr(getattr(engine, "transform", None), "gate", None)
    return gate.opened if gate is not None else None


def ddp_worker(rank: int, world_size: int, config: dict) -> dict:
    """The loop on a real DDP rank with ``gradcomp.register``; what it logged and its final parameters."""
    torch.set_num_threads(1)
    run = Rank(rank, config)
    run.train(0, config["steps"])
    return run.result()


def one_file_resume_worker(rank: int, world_size: int, out_dir: str, config: dict, split: int) -> dict:
    """Train ``split`` steps, save one file from rank 0, rebuild everything, load the file on every
    rank and finish the run."""
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    first = Rank(rank, config)
    first.train(0, split)
    saved = first.checkpoint()
    path = os.path.join(out_dir, "checkpoint.pt")
    if rank == 0:
        torch.save(saved, path)
    dist.barrier()
    second = Rank(rank, config)
    second.restore(torch.load(path, weights_only=True))
    second.train(split, config["steps"])
    return second.result()


def simulated(config: dict, world_size: int = 2) -> list:
    """The same loop on the in-process simulation of ``world_size`` ranks; one log per rank."""
    from experiments.simulate import Simulation
    from gradcomp.engine import Engine
    from gradcomp.setup import prepare

    scalers = [make_scaler(config) for _ in range(world_size)]
    schedulers = {}

    def make_optimizer(replica):
        optimizer, scheduler = build_optimizer(config, replica)
        schedulers[id(optimizer)] = scheduler
        return optimizer

    def attach(rank, replica, optimizer, transport):
        setup = prepare(config["spec"], replica.named_parameters(), optimizer=optimizer, total_steps=config["steps"],
                        scheduler=schedulers[id(optimizer)], min_compression=config.get("min_compression", 2.0),
                        grad_scaler=scalers[rank], min_numel=256, announce=False)
        return Engine(setup.compressor, transport, **setup.settings)

    sim = Simulation(make_model(), make_optimizer, attach if config.get("spec") else None, world_size)
    logs = [{"norms": [], "grads": []} for _ in range(world_size)]
    micro = config.get("accumulation", 1)
    for s in range(config["steps"]):
        for optimizer in sim.optimizers:
            if schedulers[id(optimizer)] is None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(config, s)
        for m in range(micro):
            for rank, replica in enumerate(sim.replicas):
                loss = loss_fn(replica, *batch(rank, s * micro + m)) / micro
                (scalers[rank].scale(loss) if scalers[rank] is not None else loss).backward()
            if m == micro - 1:
                sim.exchange()
        for rank, (replica, optimizer) in enumerate(zip(sim.replicas, sim.optimizers)):
            logs[rank]["grads"].append(replica[2].weight.grad.clone())
            logs[rank]["norms"].append(clip(config, replica, optimizer, scalers[rank]))
            step(config, optimizer, schedulers[id(optimizer)], scalers[rank])
    for rank, replica in enumerate(sim.replicas):
        logs[rank]["params"] = [p.detach().clone() for p in replica.parameters()]
        logs[rank]["opened"] = freeze_opened(sim.engines[rank] if sim.engines else None)
    return logs
