"""Rank workers for the two-phase exchange on real Gloo ranks, and a transport that counts bytes.

The engine is driven directly (one group of two "parameters", uneven chunk sizes), so that an
independent single-process simulation in the test can follow every rank exactly; one worker
also trains a tiny model through the DDP hook.
"""
import io

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gradcomp import from_spec
from gradcomp.engine import Engine, Transport
from gradcomp.hooks import ddp as gc_ddp
from gradcomp.hooks.ddp import TorchDistributedTransport

KEYS = ("layer.weight", "layer.bias")
NUMELS = (700, 333)  # n = 1033: chunks of unequal size for P = 3 and 4


class CountingTransport(Transport):
    """Passes every call through to ``inner`` and records ``(collective, bytes handed over)``."""

    def __init__(self, inner):
        self.inner = inner
        self.handed = []

    world_size = property(lambda self: self.inner.world_size)
    rank = property(lambda self: self.inner.rank)

    def allreduce_average(self, tensor, name):
        self.handed.append(("allreduce", tensor.numel() * tensor.element_size()))
        return self.inner.allreduce_average(tensor, name)

    def allreduce_sum(self, tensor, name):
        self.handed.append(("allreduce", tensor.numel() * tensor.element_size()))
        return self.inner.allreduce_sum(tensor, name)

    def allgather(self, buffer, name):
        self.handed.append(("allgather", buffer.numel() * buffer.element_size()))
        return self.inner.allgather(buffer, name)

    def all_to_all(self, buffer, name):
        self.handed.append(("all_to_all", buffer.numel() * buffer.element_size()))
        return self.inner.all_to_all(buffer, name)

    def can_allreduce(self, dtype, device):
        return self.inner.can_allreduce(dtype, device)

    def agree(self, fingerprint):
        return self.inner.agree(fingerprint)


def gradient(rank, step, nan=False):
    """Rank ``rank``'s float32 gradient ``[sum(NUMELS)]`` at ``step`` (a NaN at element 5 if ``nan``)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    grad = torch.randn(sum(NUMELS), generator=generator)
    if nan:
        grad[5] = float("nan")
    return grad


def make_engine(spec, exchange="two_phase", granularity="parameter"):
    return Engine(from_spec(spec), CountingTransport(TorchDistributedTransport()), warmup_steps=0, min_numel=0,
                  exchange=exchange, granularity=granularity)


def run_steps(engine, rank, steps, nan_at=None, nan_rank=None):
    """Average ``gradient(rank, step)`` for ``step`` in ``steps``; returns the averages (float32 copies)."""
    outputs = []
    for step in steps:
        grad = gradient(rank, step, nan=(step == nan_at and rank == nan_rank))
        handle = engine.start(grad, KEYS, NUMELS, "g")
        outputs.append(engine.finish(handle, handle.work.wait()[0]).clone())
        engine.end_step()
    return outputs


def snapshot(engine):
    """The engine's state through a weights-only checkpoint round trip."""
    blob = io.BytesIO()
    torch.save(engine.state_dict(), blob)
    blob.seek(0)
    return torch.load(blob, weights_only=True)


def engine_worker(rank, world_size, spec, steps, split, nan_at, nan_rank):
    """Straight run, checkpoint/resume at ``split`` and a run with a NaN on ``nan_rank`` at ``nan_at``."""
    straight = make_engine(spec)
    outputs = run_steps(straight, rank, range(steps))
    handed = list(straight.transport.handed)
    stats = straight.stats()

    first = make_engine(spec)
    run_steps(first, rank, range(split))
    resumed = make_engine(spec)
    resumed.load_state_dict(snapshot(first))
    resumed_outputs = run_steps(resumed, rank, range(split, steps))

    poisoned = make_engine(spec)
    run_steps(poisoned, rank, range(nan_at))
    before = snapshot(poisoned)
    nan_outputs = run_steps(poisoned, rank, [nan_at], nan_at=nan_at, nan_rank=nan_rank)
    after = snapshot(poisoned)
    later = run_steps(poisoned, rank, [nan_at + 1])

    # The cost model prices a group compressed whole (per parameter, each part pads to 8 bytes).
    allgather = make_engine(spec, exchange="allgather", granularity="bucket")
    run_steps(allgather, rank, range(1))
    return {"outputs": outputs, "handed": handed, "stats": stats, "resumed": resumed_outputs,
            "nan_output": nan_outputs[0], "before": before, "after": after, "later": later[0],
            "allgather_handed": list(allgather.transport.handed), "state": straight.state_dict()}


def ddp_worker(rank, world_size, spec, steps):
    """A tiny model trained through the DDP hook with ``exchange="two_phase"``; returns its parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ddp = DDP(model)
    state = gc_ddp.register(ddp, from_spec(spec), warmup_steps=1, min_numel=64, exchange="two_phase")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
    modes = {group: s["mode"] for group, s in state.stats()["last_step"]["groups"].items()}
    return {"params": [p.detach().clone() for p in model.parameters()], "modes": modes,
            "state_keys": sorted(state.state_dict())}


def mismatch_worker(rank, world_size, spec):
    """Rank 0 asks for two-phase, the others for allgather: every rank must fail before exchanging."""
    from gradcomp.engine import SettingsMismatchError

    engine = make_engine(spec, exchange="two_phase" if rank == 0 else "allgather")
    try:
        run_steps(engine, rank, range(1))
    except SettingsMismatchError as error:
        return {"error": str(error), "handed": list(engine.transport.handed)}
    return {"error": None, "handed": list(engine.transport.handed)}
