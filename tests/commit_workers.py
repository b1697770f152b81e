"""Rank workers for ``test_commit_rule.py``: float16 gradients whose float32 average overflows
only when written into the float16 gradient. Real Gloo ranks; the engine driven directly."""
import torch

from gradcomp import from_spec
from gradcomp.engine import Engine
from gradcomp.hooks.ddp import TorchDistributedTransport

KEYS, NUMELS = ("w",), (64,)


def _state(engine):
    saved = engine.state_dict()
    tensors = dict(saved["residuals"])
    tensors.update({f"owner:{k}": v for k, v in saved.get("owner_residuals", {}).items()})
    return {k: v.clone() for k, v in tensors.items()}


def overflow_worker(rank, world_size, exchange):
    """Two steps of float16 gradients of 60000 with ``TwoBit(70000)``: step 0 sends nothing (each
    entry stays in the residual), step 1 sends ``+70000``, finite in float32, Inf in float16."""
    engine = Engine(from_spec("twobit:70000.0"), TorchDistributedTransport(), warmup_steps=0, min_numel=0,
                    exchange=exchange)
    record = {}
    for step in range(2):
        grad = torch.full((sum(NUMELS),), 60000.0, dtype=torch.float16)
        before = _state(engine)
        handle = engine.start(grad, KEYS, NUMELS, "g")
        engine.finish(handle, handle.work.wait()[0])
        engine.end_step()
        record[step] = {"grad": grad.clone(), "before": before, "after": _state(engine), "mode": handle.mode}
    return record
