"""A group that changes compressor (as ``Auto`` may decide step by step) carries its residual:
nothing held back is dropped or counted twice, whatever sequence of methods the group goes through."""
import itertools

import pytest
import torch
from test_engine import OneRank

import gradcomp
from gradcomp.engine import Engine

KEYS, NUMELS = ("w", "b"), (3000, 1200)


class Sequence:
    """A policy that hands the engine a fixed sequence of compressors (``None``: dense)."""

    def __init__(self, choices):
        self.choices = itertools.cycle(choices)

    def choose(self, engine, group, numel, dtype, device, base):
        return next(self.choices)

    def finished(self, handle):
        pass

    def settings(self):
        return {}


@pytest.mark.parametrize("granularity", ["parameter", "bucket"])
def test_every_gradient_entry_is_sent_exactly_once_across_compressor_changes(granularity):
    choices = [gradcomp.TopK(0.01), gradcomp.FP16(), gradcomp.TwoBit("rms"), None, gradcomp.TopK(0.05),
               gradcomp.TwoBit(0.5), gradcomp.TopK(0.01)]
    engine = Engine(gradcomp.TopK(0.01), OneRank(), warmup_steps=0, min_numel=0, backend="torch",
                    policy=Sequence(choices), granularity=granularity)
    generator = torch.Generator().manual_seed(0)
    sent, raw = torch.zeros(sum(NUMELS), dtype=torch.float64), torch.zeros(sum(NUMELS), dtype=torch.float64)
    for step in range(len(choices)):
        grad = torch.randn(sum(NUMELS), generator=generator)
        raw += grad.double()
        handle = engine.start(grad, KEYS, NUMELS, 0)
        sent += engine.finish(handle, handle.work).double()
        engine.end_step()
        if choices[step] is None or not choices[step].uses_error_feedback:  # dense or a cast: all goes out now
            held = [engine.residual_memory.residual(k) for k in KEYS]
            assert all(r is None for r in held), f"step {step} kept residuals"  # sent, and forgotten
    held = torch.cat([engine.residual_memory.residual(k) for k in KEYS]).double()
    # With one rank the average is what was sent: sent + still held == every gradient, to fp16 rounding.
    torch.testing.assert_close(sent + held, raw, rtol=0, atol=5e-3)
    assert held.abs().max() > 0  # the last step (top-k) really held something back
