"""Rank worker of ``test_settings_fuzz.py``: many drawn configurations in one set of long-lived
Gloo ranks. Per configuration: a fresh small DDP model and gradcomp state built from this rank's
settings, a few steps, then one small allgather of every rank's outcome (and, where all ran,
of the parameters), so that the test can check that ranks agree on what happened.

A configuration is a dict of plain values (see :func:`build`); configurations of ranks that
should agree are equal dicts.
"""
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp import inflight
from gradcomp.engine import SettingsMismatchError
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.optim import FrozenVarianceAdam
from gradcomp.policy import Auto
from gradcomp.schedule import DenseWarmup, SparsityRamp

STEPS = 4
OK, MISMATCH, OTHER = 0, 1, 2
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build(config, seed):
    """``(ddp model, state, optimizer, dtype)`` of ``config``; every rank starts from the same weights."""
    torch.manual_seed(seed)
    dtype = DTYPES[config["dtype"]]
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3)).to(dtype)
    ddp = DDP(model)
    # The torch backend: the settings are under test here, not the kernels (no JIT compile per process).
    kwargs = {"min_numel": config["min_numel"], "exchange": config["exchange"], "backend": "torch"}
    if config["ramp"] is not None:
        kwargs["schedule"] = SparsityRamp(dense_steps=config["warmup"], stage_steps=config["ramp"])
    else:
        kwargs["schedule"] = DenseWarmup(config["warmup"])
    if config["policy"] is not None:
        kwargs["policy"] = Auto(**config["policy"])
    transform = config["transform"]
    if transform is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        arguments = dict(transform[1])
        optimizer = torch.optim.AdamW(model.parameters(), lr=arguments.pop("lr"))
        kwargs["transform"] = FrozenVarianceAdam(optimizer, model.named_parameters(), **arguments)
    state = gc_ddp.register(ddp, gradcomp.from_spec(config["spec"]), **kwargs)
    return ddp, state, optimizer, dtype


def _train(rank, config, seed):
    """Run :data:`STEPS` steps; ``(outcome, step of the error, error text, flat parameters or None)``."""
    try:
        ddp, state, optimizer, dtype = build(config, seed)
    except Exception as error:  # a configuration refused at construction: local, before any collective
        return OTHER, -1, f"construction: {type(error).__name__}: {error}", None
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * seed + 10 * step + rank)
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 3, generator=generator)
        try:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x.to(dtype)).float(), y)
            loss.backward()
            optimizer.step()
        except Exception as error:  # what the user would see
            cause = error
            while cause is not None and not isinstance(cause, SettingsMismatchError):
                cause = cause.__cause__ or cause.__context__
            kind = MISMATCH if cause is not None else OTHER
            return kind, step, f"{type(error).__name__}: {error}"[:2000], None
    flat = torch.cat([p.detach().reshape(-1).float() for p in ddp.module.parameters()])
    return OK, STEPS, None, flat


def fuzz_worker(rank, world_size, configs, deadline_s):
    """For each ``configs[i]`` (a list of per-rank config dicts): train, then agree on outcomes.

    Returns, per configuration: every rank's ``(outcome, step)``, whether all replicas are
    bitwise equal (``None`` unless every rank ran), this rank's error text, and seconds taken.
    Stops early (``"stopped"``) once ``deadline_s`` seconds have passed, at the same
    configuration on every rank (the decision is shared by the outcome allgather)."""
    started = time.monotonic()
    results = []
    for index, per_rank in enumerate(configs):
        began = time.monotonic()
        outcome, step, error, flat = _train(rank, per_rank[rank], seed=index)
        late = int(time.monotonic() - started > deadline_s)
        local = torch.tensor([outcome, step, late], dtype=torch.int64)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        inflight.hold(local, *gathered)  # Gloo's thread must not be the last owner at exit
        dist.all_gather(gathered, local)
        outcomes = [(int(g[0]), int(g[1])) for g in gathered]
        equal = None
        if all(o == OK for o, _ in outcomes):
            params = [torch.empty_like(flat) for _ in range(world_size)]
            inflight.hold(flat, *params)
            dist.all_gather(params, flat)
            equal = all(torch.equal(params[0].view(torch.int32), p.view(torch.int32)) for p in params[1:])
        results.append({"outcomes": outcomes, "equal": equal, "error": error, "seconds": time.monotonic() - began})
        if any(int(g[2]) for g in gathered):
            results.append("stopped")
            break
    return results
