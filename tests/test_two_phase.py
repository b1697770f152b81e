"""The two-phase compressed allreduce on 3 and 4 real Gloo ranks.

Checked against an independent single-process simulation written here from the algorithm's
definition (chunking, per-chunk compression with first-stage residuals, rank-ordered float32
average by the owner, re-compression with the owner's residual, decode, commit only if finite).
It calls the compressors' public compress/decompress_add and nothing of the exchange.
"""
import functools
import math

import pytest
import torch

import multiprocess
import two_phase_workers as workers
from gradcomp import from_spec
from gradcomp.costmodel import Cluster, Link, predict

STEPS, SPLIT, NAN_AT, NAN_RANK = 5, 2, 2, 1
CASES = [(3, "topk:0.05"), (4, "topk:0.05"), (3, "twobit:rms"), (4, "twobit:0.5")]


@functools.lru_cache(maxsize=None)
def ranks(world_size, spec, tmp_root):
    return multiprocess.spawn(workers.engine_worker, world_size, tmp_root, spec, STEPS, SPLIT, NAN_AT, NAN_RANK,
                              timeout_s=240)


# Every case starts 3 or 4 ranks: slow. The quick run keeps the in-process tests below, and
# test_commit_rule.py runs the two-phase exchange on 2 real ranks.
@pytest.fixture(scope="module", params=[pytest.param(case, marks=pytest.mark.slow) for case in CASES],
                ids=[f"P{p}-{s}" for p, s in CASES])
def case(request, tmp_path_factory):
    world_size, spec = request.param
    root = tmp_path_factory.mktemp(f"p{world_size}_{spec.replace(':', '_')}")
    return world_size, spec, ranks(world_size, spec, str(root))


def simulate(world_size, spec, steps, nan_at=None, nan_rank=None):
    """Every rank's averages, written from the definition; returns ``(outputs, first, second)``."""
    compressor = from_spec(spec)
    n = sum(workers.NUMELS)
    base, extra = divmod(n, world_size)
    sizes = [base + (1 if j < extra else 0) for j in range(world_size)]
    starts = [sum(sizes[:j]) for j in range(world_size)]
    first = [torch.zeros(n) for _ in range(world_size)]
    second = [torch.zeros(size) for size in sizes]
    outputs = []
    for step in steps:
        grads = [workers.gradient(r, step, nan=(step == nan_at and r == nan_rank)) for r in range(world_size)]
        new_first = [torch.zeros(n) for _ in range(world_size)]
        payloads = [[None] * world_size for _ in range(world_size)]  # [rank][chunk]
        for r in range(world_size):
            for j, (lo, size) in enumerate(zip(starts, sizes)):
                chunk = slice(lo, lo + size)
                out = torch.zeros(size)
                payloads[r][j] = compressor.compress(grads[r][chunk].clone(), first[r][chunk].clone(), out)
                new_first[r][chunk] = out
        result = torch.zeros(n)
        new_second = []
        for j, (lo, size) in enumerate(zip(starts, sizes)):
            average = torch.zeros(size)
            for r in range(world_size):
                compressor.decompress_add(payloads[r][j], average)
            average = average / world_size
            residual_out = torch.zeros(size)
            reduced = compressor.compress(average, second[j].clone(), residual_out)
            new_second.append(residual_out)
            decoded = torch.zeros(size)
            compressor.decompress_add(reduced, decoded)
            result[lo: lo + size] = decoded
        if bool(torch.isfinite(result).all()):
            first, second = new_first, new_second
        outputs.append(result)
    return outputs, first, second


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.multiprocess
def test_matches_simulation_and_replicas_agree(case):
    world_size, spec, results = case
    expected, first, second = simulate(world_size, spec, range(STEPS))
    for rank, result in enumerate(results):
        for step in range(STEPS):
            assert same_bits(result["outputs"][step], expected[step]), f"rank {rank} step {step}"
            assert same_bits(result["outputs"][step], results[0]["outputs"][step])
        state = result["state"]
        assert same_bits(torch.cat([state["residuals"][k] for k in workers.KEYS]), first[rank])
        (owned,) = state["owner_residuals"].values()
        assert same_bits(owned, second[rank])
        assert set(result["stats"]["last_step"]["groups"]["g"].items()) >= {("mode", "two_phase")}
    # The decoded average is close to the true mean of the gradients, not just equal to itself.
    true_mean = sum(workers.gradient(r, 0) for r in range(world_size)) / world_size
    assert torch.isfinite(expected[0]).all() and not torch.equal(expected[0], torch.zeros_like(expected[0]))
    assert torch.dot(expected[0], true_mean) > 0


@pytest.mark.multiprocess
def test_checkpoint_resume_is_bitwise(case):
    _, _, results = case
    for result in results:
        for got, want in zip(result["resumed"], result["outputs"][SPLIT:]):
            assert same_bits(got, want)


@pytest.mark.multiprocess
def test_nan_on_one_rank_commits_nothing_anywhere(case):
    world_size, spec, results = case
    for rank, result in enumerate(results):
        assert not torch.isfinite(result["nan_output"]).all(), f"rank {rank} did not see the NaN"
        for name in ("residuals", "owner_residuals"):
            before, after = result["before"][name], result["after"][name]
            assert before.keys() == after.keys() and before
            assert all(same_bits(before[k], after[k]) for k in before), f"rank {rank} committed {name}"
        assert torch.isfinite(result["later"]).all()
    expected, _, _ = simulate(world_size, spec, range(NAN_AT + 2), nan_at=NAN_AT, nan_rank=NAN_RANK)
    assert all(same_bits(r["later"], expected[NAN_AT + 1]) for r in results)


@pytest.mark.multiprocess
def test_bytes_handed_to_collectives_equal_the_cost_model(case):
    world_size, spec, results = case
    compressor, n = from_spec(spec), sum(workers.NUMELS)
    cluster = Cluster(world_size, Link(1e-5, 1e9))
    two_phase = predict("two_phase", compressor, n, cluster)
    allgather = predict("allgather", compressor, n, cluster)
    for result in results:
        handed = result["handed"]
        assert [kind for kind, _ in handed] == ["all_to_all", "allgather"] * STEPS
        per_step = [sum(b for _, b in handed[2 * s: 2 * s + 2]) for s in range(STEPS)]
        assert per_step == [two_phase.handed_bytes] * STEPS
        assert handed[0][1] == world_size * two_phase.parts["slot1"]
        assert result["stats"]["last_step"]["bytes_sent"] == two_phase.handed_bytes
        assert result["allgather_handed"] == [("allgather", allgather.handed_bytes)]
    if world_size == 4:  # the exact figures of this case, for the record
        print(f"P=4 {spec}: two_phase {two_phase.handed_bytes} B/step, allgather {allgather.handed_bytes} B, "
              f"dense {4 * n} B")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ddp_hook_replicas_agree():
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        results = multiprocess.spawn(workers.ddp_worker, 4, root, "twobit:rms", 4, timeout_s=240)
    for result in results[1:]:
        assert all(same_bits(a, b) for a, b in zip(result["params"], results[0]["params"]))
    assert "two_phase" in results[0]["modes"].values()
    assert "owner_residuals" in results[0]["state_keys"]
    assert math.isfinite(float(results[0]["params"][0].sum()))


# -- settings and checkpoints, in one process ------------------------------------------------------
class FourRanks(workers.Transport):
    """A transport that only reports a world size (mode decisions need no collective)."""

    world_size, rank = 4, 0


def test_exchange_setting_is_checked():
    from gradcomp.engine import Engine

    with pytest.raises(ValueError, match="allgather"):
        Engine(from_spec("twobit:0.5"), exchange="ring")

    class Stage:
        def __getattr__(self, name):
            return lambda *args: None

    with pytest.raises(ValueError, match="transform"):
        Engine(from_spec("topk:0.01"), exchange="two_phase", transform=Stage())
    with pytest.raises(NotImplementedError, match="exchange='allgather'"):
        workers.Transport().all_to_all(torch.zeros(8, dtype=torch.uint8), "g")


def test_mode_needs_one_element_per_rank():
    from gradcomp.engine import Engine

    engine = Engine(from_spec("twobit:0.5"), FourRanks(), min_numel=0, exchange="two_phase")
    assert engine.exchange_for(engine.compressor, 4, torch.float32, "cpu").name == "two_phase"
    assert engine.exchange_for(engine.compressor, 3, torch.float32, "cpu").name == "allgather"
    assert engine.exchange_for(from_spec("fp16"), 4096, torch.float32, "cpu").name == "allreduce"  # summable


def test_owner_residuals_load_transactionally_and_warn_when_dropped():
    from gradcomp.engine import Engine
    from gradcomp.exchanges.two_phase import owner_key

    engine = Engine(from_spec("topk:0.01"), FourRanks(), exchange="two_phase")
    saved = engine.state_dict()
    assert saved["owner_residuals"] == {}
    mine = owner_key(("w",), 4, 0)  # rank 0 of 4 owns chunk 0
    good = dict(saved, owner_residuals={mine: torch.ones(3)})
    engine.load_state_dict(good)
    assert torch.equal(engine.state_dict()["owner_residuals"][mine], torch.ones(3))
    bad_entries = (
        {"weight": torch.ones(3)},  # no two-phase exchange wrote it
        {mine: torch.tensor([float("nan")])},
        {mine: torch.tensor([1e300], dtype=torch.float64)},  # finite, but not in float32
        {owner_key(("w",), 4, 1): torch.ones(3)},  # another rank's chunk
        {owner_key(("w",), 2, 0): torch.ones(3)},  # keyed for another world size
        {mine: torch.ones(4)},  # not the size of the chunk this engine holds
    )
    for bad in bad_entries:
        with pytest.raises(ValueError):
            engine.load_state_dict(dict(saved, owner_residuals=bad))
        assert torch.equal(engine.state_dict()["owner_residuals"][mine], torch.ones(3))
    plain = Engine(from_spec("topk:0.01"), FourRanks())
    with pytest.warns(UserWarning, match="second-stage"):
        plain.load_state_dict(good)
    assert "owner_residuals" not in plain.state_dict()


def test_a_loaded_owner_residual_of_another_size_is_dropped_at_first_use_and_stale_ones_at_a_rebuild():
    from gradcomp.exchanges.two_phase import TwoPhase, owner_key

    exchange = TwoPhase()
    old, new = owner_key(("a", "b"), 4, 0), owner_key(("b", "a"), 4, 0)
    exchange.prepare_load({old: torch.ones(5)}, 4, 0)()
    with pytest.warns(UserWarning, match="dropped"):
        exchange._note_group(old, ("a", "b"), 7)  # the chunk has 7 elements: the residual cannot be it
    assert exchange.state_dict() == {}
    exchange.owner_memory.buffers([old], [7], "cpu")
    exchange.owner_memory.commit([old])
    assert list(exchange.state_dict()) == [old]
    exchange._note_group(new, ("b", "a"), 7)  # DDP rebuilt its buckets: the old group's residual is stale
    assert exchange.state_dict() == {}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_with_different_exchanges_fail_before_exchanging(tmp_path):
    results = multiprocess.spawn(workers.mismatch_worker, 2, str(tmp_path), "topk:0.05", timeout_s=240)
    for result in results:
        assert result["error"] is not None and "ranks disagree on exchange" in result["error"], result
        assert result["handed"] == []
    assert "rank 0 has 'two_phase'" in results[0]["error"]  # each rank names its own setting
