"""Rank entry points for ``test_hostile_peers.py``: 2 real Gloo ranks under DDP where one
rank corrupts its top-k payload after compressing it.

Each worker is a top-level function that ``multiprocess.spawn(..., pass_out_dir=True)`` runs; each
writes what it saw with ``torch.save`` to ``out_dir/rank{r}.pt``.
"""
import os
import traceback

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp.hooks import ddp as gc_ddp

CORRUPTIONS = ("out_of_range", "negative", "duplicate", "unsorted", "twobit_bytes", "random_bytes")


def corrupt(payload, corruption: str, seed: int = 0) -> None:
    """Overwrite a top-k payload in place, as a faulty or malicious peer would; its size and
    layout stay the same, so the allgather itself succeeds and only validation can tell."""
    indices = payload["indices"]
    if corruption == "out_of_range":
        indices[-1] = torch.iinfo(indices.dtype).max
    elif corruption == "negative":
        indices[0] = -1
    elif corruption == "duplicate":
        indices[1] = indices[0]
    elif corruption == "unsorted":
        indices.copy_(indices.flip(0))
    elif corruption == "twobit_bytes":  # what a 2-bit payload of all +t codes looks like
        payload.buffer.fill_(0x55)
    elif corruption == "random_bytes":
        generator = torch.Generator().manual_seed(seed)
        payload.buffer.copy_(torch.randint(0, 256, payload.buffer.shape, dtype=torch.uint8, generator=generator))
    else:
        raise ValueError(f"unknown corruption {corruption!r}; known: {CORRUPTIONS}")


def corrupting_topk(density: float, corruption: str, armed: dict) -> gradcomp.TopK:
    """A ``TopK`` whose payloads are corrupted after ``compress()`` while ``armed["on"]``.

    An instance of ``TopK`` itself (its ``compress`` wrapped on the instance), so its spec and
    the settings fingerprint are those of the honest compressor on the other rank and the
    cross-rank settings check passes: only payload validation can catch it.
    """
    compressor = gradcomp.TopK(density)
    honest_compress = compressor.compress

    def compress(*args, **kwargs):
        payload = honest_compress(*args, **kwargs)
        if armed["on"]:
            corrupt(payload, corruption, seed=armed["calls"])
            armed["calls"] += 1
        return payload

    compressor.compress = compress
    return compressor


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
    )


def _batch(rank, step, n=16):
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 8, generator=generator)
    return x, torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2]), x[:, 3] - x[:, 4]], dim=1)


def _tensors(value):
    """The tensors of a (nested) state dict, cloned, keyed by their path."""
    found = {}

    def walk(path, item):
        if isinstance(item, torch.Tensor):
            found[path] = item.detach().clone()
        elif isinstance(item, dict):
            for key, child in item.items():
                walk(f"{path}/{key}", child)
        elif isinstance(item, (list, tuple)):
            for index, child in enumerate(item):
                walk(f"{path}/{index}", child)

    walk("", value)
    return found


def hostile_step(rank, world_size, out_dir, corruption, backend, corrupt_rank=1, honest_steps=2, density=0.05):
    """``honest_steps`` normal compressed steps, then one where ``corrupt_rank`` corrupts its
    payload. Saves, per rank: the error text of the hostile step (``None`` if none), the
    residuals before and after it, the bucket (the gradients, which are views into DDP's
    buckets) after it, and this rank's local gradient of that step computed without DDP."""
    armed = {"on": False, "calls": 0}
    if rank == corrupt_rank:
        compressor = corrupting_topk(density, corruption, armed)
    else:
        compressor = gradcomp.TopK(density)
    model = _model()
    reference = _model()  # the same parameters, no DDP: this rank's local gradient
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=25)
    state = gc_ddp.register(ddp, compressor, warmup_steps=0, min_numel=0, backend=backend)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(honest_steps):
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()

    reference.load_state_dict(model.state_dict())
    residuals_before = _tensors(state.state_dict())
    step = honest_steps
    x, y = _batch(rank, step)
    reference.zero_grad()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    local_grads = {name: p.grad.detach().clone() for name, p in reference.named_parameters()}

    optimizer.zero_grad()
    armed["on"] = True
    error = None
    try:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    except Exception as caught:  # DDP re-raises the hook's error from backward()
        error = f"{type(caught).__name__}: {caught}\n{traceback.format_exc()}"
    armed["on"] = False
    result = {
        "error": error,
        "corrupted_payloads": armed["calls"],
        "residuals_before": residuals_before,
        "residuals_after": _tensors(state.state_dict()),
        "grads_after": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
        "local_grads": local_grads,
        "backend": backend,
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
