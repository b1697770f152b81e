"""Rank workers for gradcomp under FSDP2 (``fully_shard``) on real Gloo ranks (``test_fsdp.py``).

The model is transformer-shaped (a tied embedding and head, blocks with a layer norm and an MLP) with
nested FSDP modules (each block's MLP inside the block inside the root) and sizes that FSDP pads
unevenly for 2 and 4 ranks; ``fsdp_simulation.py`` simulates the same training without FSDP.
"""
import os
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from gradcomp.compressors.registry import spec_of
from gradcomp.hooks import fsdp as gc_fsdp

VOCAB, WIDTH, HIDDEN, MLP, BATCH = 37, 20, 30, 45, (4, 9)
#: The FSDP modules, nested ones first (``fully_shard`` order), the root (``""``) last.
UNITS = ("blocks.0.mlp", "blocks.0", "blocks.1.mlp", "blocks.1", "")
#: The engine's ``min_numel`` here: a parameter under it (biases, norms) travels dense, weights compress.
MIN_NUMEL = 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, MLP), nn.GELU(), nn.Linear(MLP, WIDTH))

    def forward(self, x):
        return x + self.mlp(self.norm(torch.tanh(self.a(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, VOCAB)
        self.head.weight = self.emb.weight  # tied, as GPT's head: FSDP reduce-scatters it once, in the root

    def forward(self, tokens):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def sharded(net: nn.Module) -> nn.Module:
    for unit in UNITS[:-1]:
        fully_shard(net.get_submodule(unit))
    return fully_shard(net)


def tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, BATCH, generator=torch.Generator().manual_seed(1000 * step + rank))


def loss_of(net, batch: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(batch).reshape(-1, VOCAB), batch.roll(-1, dims=1).reshape(-1))


class DenseAt:
    """A schedule: dense at ``steps``, the base compressor otherwise."""

    def __init__(self, steps=()):
        self.steps = tuple(steps)

    def compressor_at(self, step, base):
        return None if step in self.steps else base

    def settings(self):
        return {"kind": "dense_at", "steps": list(self.steps)}

    def state_dict(self):
        return self.settings()

    def load_state_dict(self, state_dict):
        if state_dict != self.settings():
            raise ValueError(f"another schedule: {state_dict}")


# -- the ranks ----------------------------------------------------------------------------------
def optimizer_of(net, case: dict):
    """``(SGD of the case, its LR scheduler: a linear warm-up over case["warmup"] steps, or None)``."""
    optimizer = torch.optim.SGD(net.parameters(), lr=case.get("lr", 0.5), momentum=case.get("momentum", 0.0))
    warmup = case.get("warmup")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)) if warmup else None
    return optimizer, scheduler


def _register(net, case: dict, optimizer=None, scheduler=None):
    """gradcomp on ``net``: the recipe (``case["recipe"]``) or the schedule ``DenseAt(case["dense_at"])``."""
    settings = dict(min_numel=case.get("min_numel", MIN_NUMEL), backend=case.get("backend", "torch"),
                    residual_dtype=getattr(torch, case.get("residual_dtype", "float32")),
                    residual_share=case.get("residual_share", 1.0), granularity=case.get("granularity", "parameter"))
    if case.get("recipe"):
        settings.update(optimizer=optimizer, total_steps=case["steps"], scheduler=scheduler)
    else:
        settings.update(schedule=DenseAt(case.get("dense_at", ())))
    return gc_fsdp.register(net, case["spec"], **settings)


def _full(tensors) -> dict:
    """``{name: the whole tensor}`` of DTensors (a collective: every rank calls it)."""
    return {name: t.full_tensor().clone() for name, t in tensors}


def run_steps(net, optimizer, rank: int, steps, clip: float = 0.0, scheduler=None, state=None):
    """Train ``steps``; returns ``{"grads": every step's whole averaged .grad, "norms": what clip_grad_norm_
    measured, "specs": the compressor gradcomp ran at each step (None: dense)}``."""
    out = {"grads": [], "norms": [], "specs": []}
    for step in steps:
        if state is not None:
            compressor = state.engine.compressor_now()
            out["specs"].append(None if compressor is None else spec_of(compressor))
        loss_of(net, tokens(rank, step)).backward()
        out["grads"].append(_full((n, p.grad) for n, p in net.named_parameters()))
        if clip:
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return out


def train(rank: int, world_size: int, case: dict) -> dict:
    """``case``: ``spec`` (``None``: FSDP's own reduce-scatter), ``steps``, ``dense_at`` or ``recipe``,
    ``min_numel``, ``residual_dtype``, ``residual_share``, ``granularity``, ``backend``, ``lr``, ``momentum``,
    ``warmup``, ``clip``."""
    net = sharded(model())
    optimizer, scheduler = optimizer_of(net, case)
    state = _register(net, case, optimizer, scheduler) if case["spec"] else None
    out = run_steps(net, optimizer, rank, range(case["steps"]), case.get("clip", 0.0), scheduler, state)
    out["params"] = _full(net.named_parameters())
    if state is not None:
        out.update(stats=state.stats(), residual_bytes=state.residual_bytes(), residuals=state.engine.state_dict())
    return out


def quick(rank: int, world_size: int) -> dict:
    """The quick selection's one job: top-k with a dense step between compressed ones, FSDP's own
    reduce-scatter against gradcomp's Identity, and the refusal of Adam's recipe stage."""
    topk = train(rank, world_size, {"spec": "topk:0.2", "steps": 3, "dense_at": (1,), "momentum": 0.9})
    fsdp = train(rank, world_size, {"spec": None, "steps": 2})
    identity = train(rank, world_size, {"spec": "identity", "steps": 2})
    net = sharded(model())
    try:
        gc_fsdp.register(net, "topk:0.01", optimizer=torch.optim.AdamW(net.parameters()), total_steps=100)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"topk": topk, "fsdp": fsdp, "identity": identity, "adam_refusal": refusal}


def lossless(rank: int, world_size: int) -> dict:
    """FSDP's own reduce-scatter, gradcomp's Identity (the dense path) and a lossless compressed path
    (top-k of every entry: values and indices through the all-to-all), 2 steps each."""
    return {name: train(rank, world_size, {"spec": spec, "steps": 2})
            for name, spec in (("fsdp", None), ("identity", "identity"), ("topk_all", "topk:1.0"))}


def resume(rank: int, world_size: int, out_dir: str, case: dict) -> dict:
    """Train ``case["steps"]`` straight, saving model, optimizer and gradcomp through
    ``torch.distributed.checkpoint`` at ``case["split"]``; then a fresh model, optimizer and gradcomp state
    load that checkpoint and train the rest. Returns both runs' final parameters and steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        net = sharded(model())
        optimizer, scheduler = optimizer_of(net, case)
        return net, optimizer, _register(net, case, optimizer, scheduler)

    path, split, steps = os.path.join(out_dir, "checkpoint"), case["split"], case["steps"]
    net, optimizer, state = fresh()
    run_steps(net, optimizer, rank, range(split), state=state)
    model_state, optim_state = get_state_dict(net, optimizer)
    dcp.save({"model": model_state, "optim": optim_state, "gradcomp": state}, checkpoint_id=path)
    straight = run_steps(net, optimizer, rank, range(split, steps), state=state)
    net2, optimizer2, state2 = fresh()
    model_state, optim_state = get_state_dict(net2, optimizer2)
    loaded = {"model": model_state, "optim": optim_state, "gradcomp": state2}
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(net2, optimizer2, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    step_at_load = state2.step
    resumed = run_steps(net2, optimizer2, rank, range(split, steps), state=state2)
    return {"straight": straight, "resumed": resumed, "step_at_load": step_at_load,
            "params": (_full(net.named_parameters()), _full(net2.named_parameters())),
            "residuals": (state.engine.state_dict()["residuals"], state2.engine.state_dict()["residuals"])}


def hostile(rank: int, world_size: int, out_dir: str) -> dict:
    """Rank 1 corrupts one top-k piece of the row it sends rank 0 (an index out of range) in step 1; returns
    what every rank raised and its residuals before and after."""
    from gradcomp import TopK
    from gradcomp.validation import PayloadError

    compressor, armed = TopK(0.2), {"on": False, "corrupted": 0}
    honest = compressor.compress

    def compress(*args, **kwargs):
        payload = honest(*args, **kwargs)
        if armed["on"] and not armed["corrupted"]:
            payload["indices"][-1] = torch.iinfo(payload["indices"].dtype).max
            armed["corrupted"] += 1
        return payload

    compressor.compress = compress
    net = sharded(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    state = gc_fsdp.register(net, compressor, schedule=DenseAt(), min_numel=MIN_NUMEL, backend="torch")
    run_steps(net, optimizer, rank, range(1))
    before = state.engine.state_dict()["residuals"]
    armed["on"] = rank == 1
    error = None
    try:
        loss_of(net, tokens(rank, 1)).backward()
    except PayloadError:
        error = save_error(out_dir, rank)
    dist.barrier()  # the ranks still talk to each other after the error
    return {"error": error, "corrupted": armed["corrupted"], "before": before,
            "after": state.engine.state_dict()["residuals"], "step": state.step}


class _Poison:
    """FSDP's ReduceScatter that writes NaN into the row its rank sends to itself, then calls ``inner``."""

    def __init__(self, inner, armed):
        self.inner, self.armed = inner, armed

    def allocate(self, *args, **kwargs):
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if self.armed["on"]:
            row = input_tensor.numel() // group.size()
            input_tensor[group.rank() * row] = float("nan")
        return self.inner(output_tensor, input_tensor, group, op, async_op)


def poisoned(rank: int, world_size: int) -> dict:
    """In step 1, rank 1's gradient of ``blocks.1.mlp`` holds a NaN in the row it reduces itself: only
    rank 1's average is not finite. Returns every rank's residuals before and after that step and its
    own shard of that module's gradient."""
    net = sharded(model())
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    state = gc_fsdp.register(net, "topk:0.2", schedule=DenseAt(), min_numel=MIN_NUMEL, backend="torch")
    module, armed = net.get_submodule("blocks.1.mlp"), {"on": False}
    module.set_custom_reduce_scatter(_Poison(module._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm,
                                             armed))
    run_steps(net, optimizer, rank, range(1))
    before = state.engine.state_dict()["residuals"]
    armed["on"] = rank == 1
    loss_of(net, tokens(rank, 1)).backward()
    shard = {name: p.grad.to_local().clone() for name, p in module.named_parameters()}
    return {"before": before, "after": state.engine.state_dict()["residuals"], "shard": shard}


def save_error(out_dir: str, rank: int) -> str:
    """The current exception's traceback, also in ``out_dir`` (for the test's failure report)."""
    text = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.caught"), "w") as file:
        file.write(text)
    return text
