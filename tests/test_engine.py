"""The engine on its own, with a one-rank transport (the collectives of one rank are copies):
the order of the pipeline, the extension slots, the dense flush, the transactional commit and
validation before any write. Multi-rank behaviour is tested through DDP and Horovod."""
import pytest
import torch

import gradcomp
from gradcomp.engine import Engine, Transport


class OneRank(Transport):
    """The collectives of a world of one rank: the average of one tensor is itself."""

    world_size, rank = 1, 0

    def allreduce_average(self, tensor, name):
        return tensor

    def allreduce_sum(self, tensor, name):
        return tensor

    def allgather(self, buffer, name):
        return buffer.clone()


def run(engine, grad, keys=("w",), group=0):
    handle = engine.start(grad, keys, [grad.numel()], group)
    return engine.finish(handle, handle.work)


class Recorder:
    """A transform that records the calls the engine makes, and scales what it compresses."""

    def __init__(self):
        self.calls = []

    def before_compress(self, keys, numels, grad, compressor):
        self.calls.append(("before_compress", keys))
        self.compressor = compressor
        return grad * 2

    def after_compress(self, keys, payload, compressor, numel):
        self.calls.append(("after_compress", keys, numel))

    def dense(self, keys, numels, grad):
        self.calls.append(("dense", keys))
        return grad

    def commit(self, keys, accept):
        self.calls.append(("commit", keys, bool(accept)))

    def state_dict(self):
        return {"calls": len(self.calls)}

    def load_state_dict(self, state):
        pass


def test_a_compressed_step_sends_the_compensated_gradient_and_keeps_the_rest():
    engine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=0, min_numel=0, backend="torch")
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    averaged = run(engine, grad.clone())
    assert torch.equal(averaged, torch.tensor([0.0, -4.0, 0.0, 0.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([1.0, 0.0, 0.5, 2.0]))
    engine.end_step()
    assert torch.equal(run(engine, grad.clone()), torch.tensor([0.0, -4.0, 0.0, 0.0]))  # |-4| still largest
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([2.0, 0.0, 1.0, 4.0]))


def test_warm_up_steps_are_dense_and_flush_residuals_held_from_before():
    engine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=1, min_numel=0, backend="torch")
    engine.residual_memory.load_state_dict({"residuals": {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}})
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    assert torch.equal(run(engine, grad.clone()), grad + 1)  # dense: gradient plus what was held back
    assert engine.residual_memory.residual("w") is None  # sent, so forgotten: nothing is held while dense
    assert engine.residual_memory.keys() == []
    assert engine.stats()["total"]["compression_ratio"] == 1.0


def test_dense_steps_after_a_flush_touch_no_residual_and_compression_restarts_from_zero():
    """A group that stays dense (a policy's dense verdict) costs no pass over residuals at every
    step; when compression comes back its residual starts from zeros, as a new parameter's does."""
    engine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=2, min_numel=0, backend="torch")
    engine.residual_memory.load_state_dict({"residuals": {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}})
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    assert torch.equal(run(engine, grad.clone()), grad + 1)
    engine.end_step()
    assert engine.residual_memory.flush_into(["w"], [4], grad.clone()) == []
    assert torch.equal(run(engine, grad.clone()), grad)  # the second dense step adds nothing
    engine.end_step()
    assert torch.equal(run(engine, grad.clone()), torch.tensor([0.0, -4.0, 0.0, 0.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([1.0, 0.0, 0.5, 2.0]))


def test_a_non_finite_average_leaves_the_residuals_and_the_transform_uncommitted():
    transform = Recorder()
    engine = Engine(gradcomp.TwoBit(0.5), OneRank(), warmup_steps=0, min_numel=0, backend="torch",
                    transform=transform)  # fmt: skip
    run(engine, torch.tensor([0.2, 0.1]))
    before = engine.residual_memory.residual("w").clone()
    engine.end_step()
    run(engine, torch.tensor([float("nan"), 0.1]))
    assert torch.equal(engine.residual_memory.residual("w"), before)
    assert transform.calls == [("before_compress", ("w",)), ("after_compress", ("w",), 2), ("commit", ("w",), True),
                               ("before_compress", ("w",)), ("after_compress", ("w",), 2),
                               ("commit", ("w",), False)]  # fmt: skip
    assert engine.state_dict()["transform"] == {"calls": 6}


def test_a_corrupt_payload_is_rejected_before_the_gradient_or_residuals_change():
    engine = Engine(gradcomp.TopK(0.5), OneRank(), warmup_steps=0, min_numel=0, backend="torch")
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    handle = engine.start(grad, ("w",), [4], "bucket0")
    gathered = handle.work
    # Corrupt the received copy of the honest payload: an index out of range.
    indices_offset = handle.payload.layout.segments[1].offset
    gathered[indices_offset: indices_offset + 4] = torch.tensor([9], dtype=torch.int32).view(torch.uint8)
    with pytest.raises(gradcomp.PayloadError, match="rank 0.*group 'bucket0'"):
        engine.finish(handle, gathered)
    assert torch.equal(grad, torch.tensor([1.0, -4.0, 0.5, 2.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.zeros(4))


def test_summable_compressors_go_through_compress_and_decompress():
    engine = Engine(gradcomp.FP16(), OneRank(), warmup_steps=0, min_numel=0)
    grad = torch.tensor([1.0 / 3.0, 2.0])
    assert torch.equal(run(engine, grad.clone()), grad.half().float())
    engine.end_step()
    assert engine.stats()["last_step"]["groups"][0]["mode"] == "allreduce"
    assert engine.stats()["last_step"]["bytes_sent"] == 4


def test_settings_are_validated_once_for_every_integration():
    with pytest.raises(ValueError, match="warmup_steps or a schedule"):
        Engine(gradcomp.TopK(0.1), warmup_steps=2, schedule=gradcomp.schedule.DenseWarmup(2))
    with pytest.raises(TypeError, match="lacks"):
        Engine(gradcomp.TopK(0.1), transform=object())
    with pytest.raises(TypeError, match="instance"):
        Engine(gradcomp.TopK)


class Doubling(Recorder):
    """A transform that doubles the gradient on dense steps too (as a momentum would scale it)."""

    def dense(self, keys, numels, grad):
        self.calls.append(("dense", keys))
        return grad * 2


def test_a_dense_step_applies_the_transform_to_the_gradient_before_adding_what_was_held_back():
    # The order of a compressed step, acc = transform(g) + e: a residual that already went
    # through the transform (a DGC velocity) must not go through it again.
    engine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=1, min_numel=0, backend="torch",
                    transform=Doubling())  # fmt: skip
    engine.residual_memory.load_state_dict({"residuals": {"w": torch.tensor([1.0, 1.0, 1.0, 1.0])}})
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    assert torch.equal(run(engine, grad.clone()), grad * 2 + 1)


def test_a_decayed_residual_is_the_kept_error_times_the_decay_and_a_rejected_step_leaves_it():
    """``residual_decay`` scales ``e'`` at commit: what was held back ``k`` steps ago counts
    ``decay ** k``, so a residual cannot hand back a stale spike for long; a step whose average is
    not finite leaves the committed residual exactly as it was."""
    engine = Engine(gradcomp.TopK(0.25), OneRank(), warmup_steps=0, min_numel=0, backend="torch",
                    residual_decay=0.5)  # fmt: skip
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    assert torch.equal(run(engine, grad.clone()), torch.tensor([0.0, -4.0, 0.0, 0.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([0.5, 0.0, 0.25, 1.0]))
    engine.end_step()
    run(engine, torch.tensor([float("nan"), 0.0, 0.0, 0.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([0.5, 0.0, 0.25, 1.0]))
    engine.end_step()
    # acc = g + e = [1.5, -4, 0.75, 3]: -4 sent, the rest kept and halved
    assert torch.equal(run(engine, grad.clone()), torch.tensor([0.0, -4.0, 0.0, 0.0]))
    assert torch.equal(engine.residual_memory.residual("w"), torch.tensor([0.75, 0.0, 0.375, 1.5]))


def test_the_decay_holds_in_a_group_of_several_parameters_compressed_each_on_its_own():
    """The engine's default granularity wraps a group of several parameters in a per-parameter compressor of the
    engine's own kind: the decay applies to every part's residual."""
    engine = Engine(gradcomp.TopK(0.5), OneRank(), warmup_steps=0, min_numel=0, backend="torch", residual_decay=0.5)
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    handle = engine.start(grad.clone(), ("a", "b"), [2, 2], 0)
    engine.finish(handle, handle.work)
    assert type(handle.compressor).__name__ == "PerParameter"
    assert torch.equal(engine.residual_memory.residual("a"), torch.tensor([0.5, 0.0]))
    assert torch.equal(engine.residual_memory.residual("b"), torch.tensor([0.25, 0.0]))


def test_a_transform_sees_the_compressor_the_exchange_applies_so_it_knows_what_travels_whole():
    """At the engine's default granularity a group of several parameters is compressed part by part, the parts
    under ``min_numel`` sent whole: the transform is handed that per-parameter compressor before compressing
    (an optimizer stage gives up no delay for what no residual holds back), and over a whole bucket the base."""
    for granularity, parts in (("parameter", [True, False]), ("bucket", None)):
        recorder = Recorder()
        engine = Engine(gradcomp.TopK(0.5), OneRank(), warmup_steps=0, min_numel=3, backend="torch",
                        transform=recorder, granularity=granularity)
        handle = engine.start(torch.tensor([1.0, -4.0, 0.5, 2.0, 3.0]), ("b", "w"), [2, 3], 0)
        engine.finish(handle, handle.work)
        seen = getattr(recorder.compressor, "parts", None)
        assert (seen and [part.dense for part in seen]) == parts, granularity
        assert recorder.compressor is handle.compressor


class Picks:
    """A policy that gives every group ``compressor`` (the engine's policy protocol: choose, finished)."""

    def __init__(self, compressor):
        self.compressor = compressor

    def choose(self, engine, group, numel, dtype, device, base):
        return self.compressor if base is not None else None

    def finished(self, handle):
        pass


def test_the_decay_is_for_the_engines_own_compressor_and_a_policys_other_choice_keeps_plain_feedback():
    """The recipe sets a decay for its 3-bit code under SGD; a top-k group that a policy picks
    needs what its residual gathers between sends (screened: decayed top-k ended +14.7 %)."""
    grad = torch.tensor([1.0, -4.0, 0.5, 2.0])
    for chosen, kept in ((gradcomp.TopK(0.25), [1.0, 0.0, 0.5, 2.0]), (gradcomp.TopK(0.5), [0.5, 0.0, 0.25, 0.0])):
        base = gradcomp.TwoBit("chunk") if chosen.density == 0.25 else gradcomp.TopK(0.25)
        engine = Engine(base, OneRank(), warmup_steps=0, min_numel=0, backend="torch", residual_decay=0.5,
                        policy=Picks(chosen))
        run(engine, grad.clone())
        assert torch.equal(engine.residual_memory.residual("w"), torch.tensor(kept)), (base, chosen)


@pytest.mark.parametrize("decay", [0, 1.5, -0.1, True, "0.9", float("nan")])
def test_a_residual_decay_outside_0_1_is_refused(decay):
    with pytest.raises(ValueError, match="residual_decay"):
        Engine(gradcomp.TopK(0.1), residual_decay=decay)
