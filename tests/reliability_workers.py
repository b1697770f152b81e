"""Rank entry points for the reliability tests: non-finite steps, checkpoint and
resume, mixed precision, DDP modes and a rank that dies. Real Gloo processes."""
import os
import time
import warnings

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_workers import batch, make_compressor, make_model
from gradcomp.hooks import ddp as gc_ddp


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _all_finite(model):
    return all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def nonfinite_run(rank, world_size, spec, schedule, bad_rank):
    """Train over ``schedule``: a list of ``(data_step, poisoned)``. A poisoned step puts
    an Inf into ``bad_rank``'s input only; every rank skips a step whose averaged
    gradient is not finite (what GradScaler does)."""
    model = make_model("mlp")
    ddp = DDP(model)
    state = gc_ddp.register(ddp, make_compressor(spec), warmup_steps=1, min_numel=0)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    record = {}
    for data_step, poisoned in schedule:
        optimizer.zero_grad()
        x, y = batch(rank, data_step)
        if poisoned:
            record["residuals_before"] = state.residual_memory.state_dict()["residuals"]
            if rank == bad_rank:
                x = x.clone()
                x[0, 0] = float("inf")
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        finite = _all_finite(model)
        if poisoned:
            record["finite_at_bad_step"] = finite
            record["residuals_after"] = state.residual_memory.state_dict()["residuals"]
        if finite:
            optimizer.step()
    record["params"] = _params(model)
    return record


def checkpoint_run(rank, world_size, spec, model_kind, ddp_kwargs, start, stop, ckpt_dir, save_at=None):
    """Train steps ``[start, stop)``, resuming from ``ckpt_dir`` if ``start > 0`` and
    saving there after step ``save_at``. One checkpoint per rank, as residuals are."""
    model = make_model(model_kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    checkpoint = None
    if start > 0:
        saved_rank = min(rank, len(os.listdir(ckpt_dir)) - 1)  # a larger world reuses the last file
        checkpoint = torch.load(os.path.join(ckpt_dir, f"rank{saved_rank}.pt"), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    ddp = DDP(model, **ddp_kwargs)
    state = gc_ddp.register(ddp, make_compressor(spec), warmup_steps=2, min_numel=0)
    caught = []
    if checkpoint is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state.load_state_dict(checkpoint["gradcomp"])
    for step in range(start, stop):
        optimizer.zero_grad()
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        if save_at is not None and step + 1 == save_at:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "gradcomp": state.state_dict()},
                os.path.join(ckpt_dir, f"rank{rank}.pt"),
            )
    return {"params": _params(model), "warnings": [str(w.message) for w in caught], "step": state.step}


def mixed_precision_run(rank, world_size, dtype, specs, steps):
    """Train a half/bfloat16 model with each compressor; report residual dtypes,
    parameters and losses."""
    results = {}
    for spec in specs:
        model = make_model("mlp").to(dtype)
        ddp = DDP(model)
        state = gc_ddp.register(ddp, make_compressor(spec), warmup_steps=0, min_numel=0)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        losses = []
        for step in range(steps):
            optimizer.zero_grad()
            x, y = batch(rank, step % 2)
            loss = torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        residual_dtypes = {str(state.residual_memory.residual(key).dtype) for key in state.residual_memory.keys()}
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters()}
        results[spec] = {"params": _params(model), "losses": losses, "residual_dtypes": residual_dtypes,
                         "grad_dtypes": grad_dtypes}
    return results


class PartlyUsed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = make_model("mlp")
        self.unused = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.used(x)


def ddp_modes_run(rank, world_size, mode, specs, steps):
    """Gradients per step under ``mode``: ``no_sync`` (accumulate two micro-batches),
    ``static_graph`` or ``unused`` (find_unused_parameters with an unused layer).
    ``specs`` may include ``None``: DDP's built-in allreduce."""
    results = {}
    for spec in specs:
        torch.manual_seed(0)
        model = PartlyUsed() if mode == "unused" else make_model("mlp")
        kwargs = {"static_graph": {"static_graph": True}, "unused": {"find_unused_parameters": True}}.get(mode, {})
        ddp = DDP(model, **kwargs)
        if spec is not None:
            gc_ddp.register(ddp, make_compressor(spec), warmup_steps=0, min_numel=0)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        grads = []
        for step in range(steps):
            optimizer.zero_grad()
            if mode == "no_sync":
                with ddp.no_sync():
                    x, y = batch(rank, 2 * step)
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                x, y = batch(rank, 2 * step + 1)
            else:
                x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
            optimizer.step()
        results[str(spec)] = {"grads": grads, "params": _params(model)}
    return results


def dying_rank_run(rank, world_size, spec, die_at):
    """Rank 1 exits abruptly at step ``die_at``; the survivors report the error they got."""
    model = make_model("mlp")
    ddp = DDP(model)
    gc_ddp.register(ddp, make_compressor(spec), warmup_steps=0, min_numel=0)
    for step in range(die_at + 50):
        if rank == 1 and step == die_at:
            os._exit(3)
        started = time.monotonic()
        try:
            x, y = batch(rank, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        except Exception as error:  # what the user would see
            return {"error": f"{type(error).__name__}: {error}", "step": step, "seconds": time.monotonic() - started}
    return {"error": None}


# -- ranks that disagree (tests/test_agreement.py) ---------------------------------------------------
def _transform_of(model, state_kwargs):
    """Replace ``state_kwargs["transform"]``, ``("adamw", arguments)`` (``lr``, ``betas`` of the
    optimizer; ``freeze_step``, ``exchange`` of the stage), by a user's AdamW and its
    :class:`~gradcomp.optim.FrozenVarianceAdam` on ``model``; returns the optimizer to step (or ``None``)."""
    from gradcomp.optim import FrozenVarianceAdam

    spec = state_kwargs.pop("transform", None)
    if spec is None:
        return None
    _, arguments = spec
    arguments = dict(arguments)
    optimizer = torch.optim.AdamW(model.parameters(), lr=arguments.pop("lr", 1e-3),
                                  betas=arguments.pop("betas", (0.9, 0.999)))
    state_kwargs["transform"] = FrozenVarianceAdam(optimizer, model.named_parameters(),
                                                   freeze_step=arguments.pop("freeze_step", 10), **arguments)
    return optimizer


def _disagreeing_step(rank, compressor, state_kwargs, steps=3):
    """Train ``steps`` steps with settings that may differ per rank; the error each rank got."""
    from gradcomp.engine import SettingsMismatchError

    model = make_model("mlp")
    ddp = DDP(model)
    state_kwargs = dict(state_kwargs)
    optimizer = _transform_of(model, state_kwargs)
    state = gc_ddp.register(ddp, compressor, **state_kwargs)
    started = time.monotonic()
    for step in range(steps):
        try:
            x, y = batch(rank, step)
            if optimizer is not None:
                optimizer.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if optimizer is not None:
                optimizer.step()
        except Exception as error:  # what the user would see
            cause = error
            while cause is not None and not isinstance(cause, SettingsMismatchError):
                cause = cause.__cause__ or cause.__context__
            return {"error": f"{type(error).__name__}: {error}", "mismatch": cause is not None, "step": step,
                    "seconds": time.monotonic() - started}
    return {"error": None, "stats": state.stats()}


def disagreement_run(rank, world_size, cases):
    """For each case ``(label, settings of rank 0, settings of rank 1)`` (each ``(spec, state
    kwargs)``), train a fresh DDP model with this rank's settings; the last case should agree."""
    from gradcomp.compressors import from_spec

    results = {}
    for label, *per_rank in cases:
        spec, kwargs = per_rank[rank]
        results[label] = _disagreeing_step(rank, from_spec(spec), kwargs)
    return results
