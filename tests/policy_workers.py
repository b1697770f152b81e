"""Rank workers for ``gradcomp.policy.Auto`` on real Gloo ranks, through the DDP hook."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.policy import DEFAULT_CANDIDATES, Auto

WARMUP = 2


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def link_hook(link_s_by_rank, kernel_scale_by_rank, rank, step_s_by_rank=None, exchange_s=None, trial_steps=2):
    """A measurement hook that gives each rank its own (injected) link time and scaled kernel times;
    with ``step_s_by_rank`` (``[{"uncompressed": s, "compressed": s}]`` per rank) its whole steps' times too
    (a list of seconds: one per trial, of ``trial_steps`` steps of each arm; the last one for later trials),
    with ``exchange_s`` every exchange's time after the decision."""
    taken = {"uncompressed": 0, "compressed": 0}

    def hook(kind, group, seconds):
        if kind == "link":
            return link_s_by_rank[rank]
        if kind == "exchange" and exchange_s is not None:
            return exchange_s
        if kind == "step" and step_s_by_rank is not None:
            value = step_s_by_rank[rank][group]
            if isinstance(value, list):
                value = value[min(taken[group] // trial_steps, len(value) - 1)]
            taken[group] += 1
            return value
        return seconds * kernel_scale_by_rank[rank]

    return hook


def drifting_hook(rank):
    """A very slow link in warm-up, then exchanges that take almost nothing: the link got faster."""

    def hook(kind, group, seconds):
        return {"link": 4.0 + rank, "exchange": 1e-7}.get(kind, seconds)

    return hook


def auto_worker(rank, world_size, link_s_by_rank, kernel_scale_by_rank, steps, recheck_every=100,
                step_s_by_rank=None, trial_steps=8, exchange_s=None, candidates=DEFAULT_CANDIDATES):
    """Train ``steps`` steps with Auto of ``candidates``; return the parameters, the policy's stats and
    choices per step. ``link_s_by_rank`` ``"drift"``: :func:`drifting_hook`."""
    model = DDP(make_model(), bucket_cap_mb=0.05)
    state = gc_ddp.register(model, gradcomp.TopK(0.01), warmup_steps=WARMUP)
    hook = (drifting_hook(rank) if link_s_by_rank == "drift"
            else link_hook(link_s_by_rank, kernel_scale_by_rank, rank, step_s_by_rank, exchange_s))
    state.engine.policy = Auto(candidates, measurement_hook=hook, recheck_every=recheck_every,
                               trial_steps=trial_steps)
    return train(model, torch.optim.SGD(model.parameters(), lr=0.05), state, rank, steps)


def train(model, optimizer, state, rank, steps, after_step=lambda: None):
    """``steps`` steps on rank ``rank``'s own data; the parameters, the policy's stats and each step's
    exchange per group (``after_step`` runs after each step)."""
    modes = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(16, 64, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        modes.append({g: s["mode"] for g, s in state.stats()["last_step"]["groups"].items()})
        after_step()
    return {"params": [p.detach().clone() for p in model.parameters()], "policy": state.stats()["policy"],
            "modes": modes}


def auto_recipe_worker(rank, world_size, step_s_by_rank, steps, total_steps, candidates=("topk:0.01",)):
    """:func:`auto_worker` through the one-call recipe under AdamW (its frozen-variance stage), a slow
    injected link, injected whole-step times and ``candidates``; per step also whether the stage was suspended
    after it and how many parameters the stage stepped itself (their gradients cleared for the optimizer)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*freezing Adam's variance.*")
    model = DDP(make_model(), bucket_cap_mb=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = link_hook([3.0, 5.0], [1.0, 1.0], rank, step_s_by_rank)
    state = gc_ddp.register(model, gradcomp.TopK(0.01), optimizer=optimizer, total_steps=total_steps,
                            policy=Auto(candidates, measurement_hook=hook, trial_steps=2))
    stage = state.engine.transform
    cleared = []  # read after the stage's own step pre-hook, registered before this one
    optimizer.register_step_pre_hook(lambda *_: cleared.append(len(stage._cleared)))
    suspended = []
    result = train(model, optimizer, state, rank, steps, after_step=lambda: suspended.append(stage.suspended))
    return {**result, "suspended": suspended, "cleared": cleared, "dense_steps": state.recipe.dense_steps,
            "frozen_denoms": sum("frozen_denom" in optimizer.state[p] for p in model.parameters())}


def auto_error_worker(rank, world_size, link_s_by_rank, kernel_scale_by_rank, steps):
    """:func:`auto_worker`, returning the error a rank got (``{"error": text}``) instead of raising."""
    try:
        return auto_worker(rank, world_size, link_s_by_rank, kernel_scale_by_rank, steps)
    except Exception as error:  # what the user would see
        return {"error": f"{type(error).__name__}: {error}"}
