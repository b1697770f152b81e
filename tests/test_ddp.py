"""The DDP hook across real Gloo processes (2 and 3 ranks), against DDP itself and
against an independent single-process simulation of warm-up + error feedback +
compressor + rank-ordered average."""
import math
import pickle

import pytest
import torch

import ddp_workers as workers
import gradcomp
import multiprocess
from gradcomp.hooks import ddp as gc_ddp


# -- the independent simulation ------------------------------------------------------------
def twobit_by_hand(acc, t):
    sent = torch.where(acc >= t, torch.tensor(t), torch.where(acc <= -t, torch.tensor(-t), torch.tensor(0.0)))
    return sent


def topk_by_hand(acc, ratio):
    """Top-k of ``acc``; ``ratio`` a density, or ``"D,entries=compact"``: density D, values rounded to bfloat16."""
    compact = isinstance(ratio, str)
    density = float(ratio.split(",")[0]) if compact else ratio
    k = max(1, math.ceil(density * acc.numel()))
    sent = torch.zeros_like(acc)
    index = torch.topk(acc.abs(), k).indices  # random data: no ties at the boundary
    sent[index] = acc[index].to(torch.bfloat16).float() if compact else acc[index]
    return sent


def simulate(spec, steps, world_size, warmup_steps, model_kind, lr=0.05, granularity="parameter"):
    """Averaged gradient per step and parameter, computed in one process.

    Each rank's gradient comes from a local copy of the model; warm-up steps average as
    DDP does (divide, then sum); compressed steps apply ``acc = g + e``, the compressor
    rule written out by hand, ``e = acc - sent`` and ``(sent_0 + ... + sent_{P-1}) / P``.
    With ``granularity="parameter"`` (the engine's default) each parameter is compressed
    alone; with ``"bucket"`` TopK runs over all parameters at once, so use it with a
    single-bucket model (TwoBit with a fixed threshold is elementwise either way).
    """
    name, arg = spec
    model = workers.make_model(model_kind)
    names = [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    residuals = [{n: torch.zeros_like(p).view(-1) for n, p in model.named_parameters()} for _ in range(world_size)]
    history = []
    for step in range(steps):
        local = [workers.local_gradients(model, rank, step) for rank in range(world_size)]
        average = {}
        if step < warmup_steps:
            for n in names:
                total = local[0][n] / world_size
                for rank in range(1, world_size):
                    total = total + local[rank][n] / world_size
                average[n] = total
        else:
            total = None
            for rank in range(world_size):
                acc = torch.cat([local[rank][n].view(-1) + residuals[rank][n] for n in names])
                by_hand = (lambda a: twobit_by_hand(a, arg)) if name == "twobit" else (lambda a: topk_by_hand(a, arg))
                if granularity == "bucket":
                    sent = by_hand(acc)
                else:
                    sizes = [residuals[rank][n].numel() for n in names]
                    sent = torch.cat([by_hand(piece) for piece in acc.split(sizes)])
                offset = 0
                for n in names:
                    size = residuals[rank][n].numel()
                    residuals[rank][n] = (acc - sent)[offset : offset + size]
                    offset += size
                total = sent if total is None else total + sent
            total = total / world_size
            offset = 0
            for n, p in model.named_parameters():
                average[n] = total[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        for n, p in model.named_parameters():
            p.grad = average[n].clone()
        optimizer.step()
        history.append(average)
    return history


def assert_grads_equal(recorded, simulated):
    for step, (got, want) in enumerate(zip(recorded, simulated)):
        for name in want:
            diff = (got[name] - want[name]).abs().max()
            assert torch.equal(got[name], want[name]), f"step {step} {name}: max diff {diff}"


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_identity_hook_gives_the_same_gradients_as_ddp_without_hook(tmp_path, world_size):
    results = multiprocess.spawn(workers.identity_vs_builtin, world_size, str(tmp_path), 5)
    for result in results:
        assert_grads_equal(result["identity"], result["builtin"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_sparse_gradient_is_averaged_as_ddp_averages_it_beside_compressed_buckets(tmp_path):
    """An embedding with sparse=True under the top-k recipe: its bucket goes by DDP's sparse allreduce, uncompressed,
    on every step (bitwise DDP's gradients while the recipe starts dense), and the dense bucket is compressed."""
    steps = 8
    results = multiprocess.spawn(workers.sparse_embedding_vs_builtin, 2, str(tmp_path), steps)
    for result in results:
        builtin, recipe = result["builtin"], result["recipe"]
        for step in range(2):  # the recipe's exact dense start
            for name, value in builtin["grads"][step].items():
                assert torch.equal(torch.as_tensor(recipe["grads"][step][name]), torch.as_tensor(value)), (step, name)
        assert all(grads["embedding_is_sparse"] for grads in recipe["grads"])
        assert all(sorted(modes.values()) == ["allgather", "sparse"] for modes in recipe["modes"][2:])
        assert not torch.equal(recipe["params"]["head.weight"], builtin["params"]["head.weight"])  # compressed
    for name, value in results[0]["recipe"]["params"].items():
        assert torch.equal(value, results[1]["recipe"]["params"][name]), name


CASES = [
    # (compressor spec, world size, warm-up steps, granularity)
    (("topk", 0.01), 2, 2, "parameter"),
    (("twobit", 0.02), 2, 2, "parameter"),
    (("topk", 0.01), 3, 0, "parameter"),
    (("twobit", 0.02), 3, 0, "parameter"),
    (("topk", 0.01), 2, 2, "bucket"),
    (("topk", "0.02,entries=compact"), 2, 2, "parameter"),
]


# Every job on real ranks in this file is slow; the quick selection keeps the in-process tests of the hook.
# (test_optim_ddp.py and test_fsdp.py keep a 2-rank run against an independent simulation quick.)
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("spec,world_size,warmup,granularity", CASES, ids=lambda c: str(c))
def test_compressed_training_matches_simulation_and_ranks_stay_bitwise_equal(tmp_path, spec, world_size, warmup,
                                                                             granularity):
    steps = 20
    results = multiprocess.spawn(
        workers.train_and_record, world_size, str(tmp_path), spec, steps, "mlp",
        {"warmup_steps": warmup, "min_numel": 0, "granularity": granularity},
    )  # fmt: skip
    for rank in range(1, world_size):
        for name, value in results[0]["params"].items():
            assert torch.equal(results[rank]["params"][name], value), f"rank {rank} diverged in {name}"
    compressed_steps = [s for s, _, _ in results[0]["layouts"] if s >= warmup]
    assert len(compressed_steps) >= steps - warmup  # the compressed path really ran
    assert_grads_equal(results[0]["grads"], simulate(spec, steps, world_size, warmup, "mlp", granularity=granularity))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_residuals_follow_their_parameters_across_the_bucket_rebuild(tmp_path):
    # Compression from step 0, so residuals exist before DDP rebuilds its buckets.
    spec, steps = ("twobit", 0.02), 6
    results = multiprocess.spawn(
        workers.train_and_record, 2, str(tmp_path), spec, steps, "shuffled",
        {"warmup_steps": 0, "min_numel": 0}, {"bucket_cap_mb": 0.001},
    )
    layouts = results[0]["layouts"]
    before = [names for step, _, names in layouts if step == 0]
    after = [names for step, _, names in layouts if step == 1]
    assert before != after and len(after) > 1, f"the bucket layout did not change: {before} -> {after}"
    assert_grads_equal(results[0]["grads"], simulate(spec, steps, 2, 0, "shuffled"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_error_feedback_keeps_topk_within_5_percent_of_dense_and_beats_no_feedback(tmp_path):
    loss = multiprocess.spawn(workers.convergence, 2, str(tmp_path), 200, 0.01, 0.1)[0]
    assert loss["topk_ef"] <= 1.05 * loss["dense"], loss
    assert loss["topk_no_ef"] > 1.5 * loss["topk_ef"], loss


@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 3])
def test_the_gloo_allgather_gives_every_rank_every_payload_in_rank_order(tmp_path, world_size):
    # Two groups in flight, waited in the other order; each group's receives posted before its sends, the groups
    # in the order of the calls, by gradcomp.hooks.direct's posting thread, never the caller's (a Gloo pair's
    # lock held by the training thread makes the pair's event loop spin on its core).
    peers = world_size - 1
    for result in multiprocess.spawn(workers.direct_allgathers, world_size, tmp_path):
        assert result["gathered"] == [[100 + r for r in range(world_size) for _ in range(3)],
                                      [10 * r + i for r in range(world_size) for i in range(5)]]
        assert [kind for kind, _ in result["posts"]] == (["irecv"] * peers + ["isend"] * peers) * 2
        assert {thread for _, thread in result["posts"]} == {"gradcomp-direct-post"} != {result["caller"]}


@pytest.mark.multiprocess
def test_a_peer_that_leaves_fails_the_gloo_allgather_instead_of_hanging(tmp_path):
    # The completion thread hands the works' error to the future the engine waits on.
    error = multiprocess.spawn(workers.direct_allgather_with_a_departed_peer, 2, tmp_path, timeout_s=120)[0]
    assert error is not None and error != "no error" and "by peer" in error, error  # closed or reset


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stats_report_exactly_the_bytes_handed_to_the_collectives(tmp_path):
    results = multiprocess.spawn(workers.count_collective_bytes, 2, str(tmp_path), 4)
    for result in results:
        assert [r["bytes_sent"] for r in result["reported"]] == result["handed"]
        assert result["total"] == sum(result["handed"])
        assert result["reported"][0]["modes"] == ["dense"]  # warm-up
        assert "allgather" in result["reported"][-1]["modes"] and "dense" in result["reported"][-1]["modes"]
        assert result["handed"][-1] < result["handed"][0] / 3
        # The settings check between ranks: one tiny collective per bucket at set-up (step 0)
        # and after DDP's bucket rebuild (step 1), none afterwards.
        agreement = [r["agreement"] for r in result["reported"]]
        assert agreement[0] >= 1 and agreement[1] == agreement[0] + result["buckets"] == agreement[-1], agreement


# -- state object, no processes needed -----------------------------------------------------------
def test_state_pickles_without_its_process_group():
    model = torch.nn.Linear(4, 2)
    named = model.named_parameters()
    state = gc_ddp.CompressionState(gradcomp.TopK(0.1), process_group=object(), named_parameters=named)
    state.residual_memory.buffers(["weight"], [8], "cpu")[0].fill_(3.0)
    state.step = 7
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.step == 7 and clone.engine.compressor.density == 0.1
    assert torch.equal(clone.residual_memory.residual("weight"), torch.full((8,), 3.0))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"compressor": "topk"}, TypeError, "gradcomp.Compressor"),
        ({"compressor": torch.nn.Linear(1, 1)}, TypeError, "gradcomp.Compressor"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps"),
        ({"warmup_steps": 1.5}, ValueError, "warmup_steps"),
        ({"min_numel": -5}, ValueError, "min_numel"),
        ({"backend": "opencl"}, ValueError, "backend"),
    ],
)
def test_state_rejects_bad_arguments_with_a_clear_message(kwargs, error, match):
    arguments = {"compressor": gradcomp.TwoBit(0.5), **kwargs}
    with pytest.raises(error, match=match):
        gc_ddp.CompressionState(**arguments)


def test_register_needs_a_ddp_model():
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gc_ddp.register(torch.nn.Linear(2, 2), gradcomp.TopK(0.1))


def test_state_dict_without_parameter_names_says_how_to_fix_it():
    state = gc_ddp.CompressionState(gradcomp.TopK(0.1))
    state.residual_memory.buffers([("id", 1)], [4], "cpu")
    with pytest.raises(RuntimeError, match="named_parameters"):
        state.state_dict()


@pytest.mark.multiprocess
@pytest.mark.slow  # two pairs of 2-rank runs; test_numba_kernels checks the backends' bits in-process
@pytest.mark.parametrize("spec", [("twobit", 0.02), ("topk", 0.01)], ids=str)
def test_hook_uses_numba_automatically_on_cpu_and_matches_the_torch_backend(tmp_path, monkeypatch, spec):
    monkeypatch.delenv("GRADCOMP_BACKEND", raising=False)
    (tmp_path / "auto").mkdir(), (tmp_path / "torch").mkdir()
    kwargs = {"warmup_steps": 0, "min_numel": 0}
    auto = multiprocess.spawn(workers.train_and_record, 2, str(tmp_path / "auto"), spec, 6, "mlp", kwargs)
    reference = multiprocess.spawn(
        workers.train_and_record, 2, str(tmp_path / "torch"), spec, 6, "mlp", {**kwargs, "backend": "torch"}
    )
    assert {b["backend"] for b in auto[0]["stats"]["last_step"]["groups"].values()} == {"numba"}
    assert {b["backend"] for b in reference[0]["stats"]["last_step"]["groups"].values()} == {"torch"}
    # Same canonical tie rule on both backends: the same sets, so the same bits.
    assert_grads_equal(auto[0]["grads"], reference[0]["grads"])
