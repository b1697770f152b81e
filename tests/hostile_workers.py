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


def corrupt(payload, corruption: str, seed: int = 0) -> bool:
    """Overwrite a top-k payload in place, as a faulty or malicious peer would; its size and
    layout stay the same, so the allgather itself succeeds and only validation can tell.
    Returns whether the payload changed (reordering needs at least two indices)."""
    indices = payload["indices"]
    if corruption in ("duplicate", "unsorted") and indices.numel() < 2:
        return False
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
    return True


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
        if armed["on"] and corrupt(payload, corruption, seed=armed["calls"]):
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


# -- the two-phase exchange (test_hostile_peers.py) -------------------------------------------------
TWO_PHASE_CASES = [
    # (phase whose payload the hostile rank corrupts, compressor spec, corruption)
    (1, "topk:0.05", "out_of_range"),
    (1, "topk:0.05", "duplicate"),
    (1, "twobit:rms", "negative_scale"),
    (2, "topk:0.05", "out_of_range"),
    (2, "twobit:rms", "negative_scale"),
    (1, "twobit:chunk", "negative_scale"),
]
TWO_PHASE_KEYS, TWO_PHASE_NUMELS = ("layer.weight", "layer.bias"), (700, 333)


def _corrupt_any(payload, corruption):
    if corruption == "negative_scale":  # a 2-bit payload of the "rms" and "chunk" modes ships its levels
        names = [segment.name for segment in payload.layout.segments]
        payload["scale" if "scale" in names else "scales"].fill_(-1.0)
    else:
        corrupt(payload, corruption)


def corrupting(spec, corruption, armed):
    """The compressor of ``spec`` whose ``compress`` corrupts the payloads of phase ``armed["phase"]``
    (calls ``0 .. P-1`` of a step are phase 1's chunks, call ``P`` is phase 2) while ``armed["on"]``."""
    compressor = gradcomp.from_spec(spec)
    honest_compress = compressor.compress

    def compress(*args, **kwargs):
        payload = honest_compress(*args, **kwargs)
        if armed["on"]:
            call = armed["call"]
            armed["call"] += 1
            if (call < armed["world_size"]) == (armed["phase"] == 1):
                _corrupt_any(payload, corruption)
                armed["corrupted"] += 1
        return payload

    compressor.compress = compress
    return compressor


def two_phase_hostile(rank, world_size, out_dir, backend, corrupt_rank=1, honest_steps=2):
    """For each of :data:`TWO_PHASE_CASES`: a fresh two-phase engine, ``honest_steps`` steps, then a
    step in which ``corrupt_rank`` corrupts its payloads of one phase. Saves per case: the error
    text (``None`` if none), seconds the step took, the gradient and the state before and after."""
    import time

    from gradcomp.engine import Engine
    from gradcomp.hooks.ddp import TorchDistributedTransport

    results = {}
    for phase, spec, corruption in TWO_PHASE_CASES:
        armed = {"on": False, "call": 0, "corrupted": 0, "phase": phase, "world_size": world_size}
        compressor = corrupting(spec, corruption, armed) if rank == corrupt_rank else gradcomp.from_spec(spec)
        engine = Engine(compressor, TorchDistributedTransport(), warmup_steps=0, min_numel=0, exchange="two_phase",
                        backend=backend)
        grad = None
        for step in range(honest_steps + 1):
            generator = torch.Generator().manual_seed(1000 * step + rank)
            grad = torch.randn(sum(TWO_PHASE_NUMELS), generator=generator)
            if step == honest_steps:
                before, grad_before = _tensors(engine.state_dict()), grad.clone()
                armed["on"] = True
            started = time.monotonic()
            error = None
            try:
                handle = engine.start(grad, TWO_PHASE_KEYS, TWO_PHASE_NUMELS, "g")
                engine.finish(handle, handle.work.wait()[0])
            except Exception as caught:  # what the user would see
                error = f"{type(caught).__name__}: {caught}\n{traceback.format_exc()}"
            engine.end_step()
            if step < honest_steps:
                assert error is None, error
        results[(phase, spec, corruption)] = {
            "error": error, "seconds": time.monotonic() - started, "corrupted": armed["corrupted"],
            "before": before, "after": _tensors(engine.state_dict()), "grad_before": grad_before,
            "grad_after": grad.clone()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
