"""Horovod integration across real ``horovodrun -np 2 --gloo`` ranks (no mocks).

One horovodrun job (tests/horovod_worker.py) runs every scenario and saves its results;
the tests below assert on them, against Horovod's own DistributedOptimizer and against
an independent single-process re-derivation of every averaged gradient.

Horovod is a hard requirement here: if it is not importable every test FAILS, because
CI builds it (scripts/build_horovod.sh).
"""
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gradcomp
import horovod_worker as worker
import multiprocess
from gradcomp.exchanges import names as exchange_names

try:
    import horovod
    import horovod.torch as hvd

    from gradcomp.hooks import horovod as gc_hvd

    HOROVOD_ERROR = None
except ImportError as error:  # reported by the fixture below as a failure, not a skip
    HOROVOD_ERROR = error

pytestmark = [pytest.mark.horovod, pytest.mark.multiprocess]
REPO = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def require_horovod():
    if HOROVOD_ERROR is not None:
        pytest.fail(
            f"Horovod is not importable ({HOROVOD_ERROR}); build it with scripts/build_horovod.sh. "
            "These tests do not skip: CI builds Horovod."
        )


# The horovodrun job is slow: every test that reads it is marked slow. The quick run keeps the
# in-process tests of the protocol and the argument checks at the end of this file.
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results from one horovodrun job."""
    if HOROVOD_ERROR is not None:
        pytest.fail(f"Horovod is not importable ({HOROVOD_ERROR}); build it with scripts/build_horovod.sh")
    out = tmp_path_factory.mktemp("horovod")
    multiprocess.horovodrun(REPO / "tests" / "horovod_worker.py", [str(out)], worker.WORLD_SIZE, LAUNCH_TIMEOUT_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(worker.WORLD_SIZE)]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def max_abs_diff(a: dict, b: dict) -> float:
    return max((a[n].float() - b[n].float()).abs().max().item() for n in a)


# -- the independent simulation ---------------------------------------------------------
def sent_by_hand(spec, acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What one rank's payload decodes to, for ``acc`` (float32), written out by hand."""
    name, arg = spec
    if name == "topk":
        k = max(1, math.ceil(arg * acc.numel()))
        index = torch.topk(acc.abs(), k).indices  # regression gradients: no ties at the boundary
        sent = torch.zeros_like(acc)
        sent[index] = acc[index].to(dtype).float()  # values travel in the gradient's dtype
        return sent
    if name == "twobit":
        t = torch.tensor(arg, dtype=torch.float32)
        return torch.where(acc >= t, t, torch.where(acc <= -t, -t, torch.zeros(())))
    assert name == "bf16"
    return acc.to(torch.bfloat16).float()


def simulate(cfg):
    """Averaged gradients, final parameters and residuals of an EXACT scenario, in one process.

    Every rank holds the same parameters, so one model serves all: each step computes each
    rank's gradient on that rank's data. A unit (a parameter, or all of them for
    ``groups=1``) in warm-up or under ``min_numel`` averages as Horovod's Gloo allreduce
    does for two ranks, ``(g0 + g1) * 0.5``; a compressed unit applies ``acc = g + e``,
    the compressor's rule by hand, ``e = acc - sent`` and ``(0 + sent_0 + sent_1) / 2``.
    """
    dtype = cfg.get("dtype", torch.float32)
    spec, world_size = cfg["compressor"], worker.WORLD_SIZE
    feedback = spec[0] != "bf16"
    model = worker.make_model(dtype)
    optimizer = worker.make_sgd(model)
    names = [n for n, _ in model.named_parameters()]
    units = [tuple(names)] if cfg["groups"] == 1 else [(n,) for n in names]
    data = [worker.make_data(rank, dtype) for rank in range(world_size)]
    residuals = [{} for _ in range(world_size)]
    history = []
    for step in range(cfg["steps"]):
        local = []
        for rank in range(world_size):
            model.zero_grad()
            worker.backward_passes(model, data[rank], cfg["passes"])
            local.append({n: p.grad.clone() for n, p in model.named_parameters()})
        average = {}
        for unit in units:
            flats = [torch.cat([local[rank][n].reshape(-1) for n in unit]) for rank in range(world_size)]
            if step < cfg["warmup_steps"] or flats[0].numel() < cfg["min_numel"]:
                assert world_size == 2 and dtype == torch.float32  # the one-add sum of two ranks
                total = (flats[0] + flats[1]) * 0.5
            else:
                total = torch.zeros(flats[0].numel())
                for rank in range(world_size):
                    acc = flats[rank].float()
                    if feedback:
                        acc = acc + residuals[rank].get(unit, torch.zeros_like(acc))
                    # The engine compresses each parameter of a group on its own (granularity "parameter").
                    sizes = [local[0][n].numel() for n in unit]
                    sent = torch.cat([sent_by_hand(spec, piece, dtype) for piece in acc.split(sizes)])
                    if feedback:
                        residuals[rank][unit] = acc - sent
                    total = total + sent
                total = total / world_size
            offset = 0
            for n in unit:
                size = local[0][n].numel()
                average[n] = total[offset : offset + size].view(local[0][n].shape).to(dtype)
                offset += size
        for n, p in model.named_parameters():
            p.grad = average[n].clone()
        optimizer.step()
        history.append(average)
    by_name = [{} for _ in range(world_size)]
    for rank in range(world_size):
        for unit, residual in residuals[rank].items():
            offset = 0
            for n in unit:
                size = local[0][n].numel()
                by_name[rank][n] = residual[offset : offset + size]
                offset += size
    return history, worker.params_of(model), by_name


@pytest.fixture(scope="module")
def simulations():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: same kernels, same rounding
    try:
        return {name: simulate(cfg) for name, cfg in worker.EXACT.items()}
    finally:
        torch.set_num_threads(threads)


# -- the drop-in optimizer: exactness ----------------------------------------------------
@pytest.mark.parametrize("scenario", list(worker.EXACT))
@pytest.mark.slow
def test_ranks_hold_bitwise_equal_gradients_and_parameters(ranks, scenario):
    first, second = (r["exact"][scenario] for r in ranks)
    assert len(first["grads"]) == worker.EXACT[scenario]["steps"]
    for step, (a, b) in enumerate(zip(first["grads"], second["grads"])):
        for name in a:
            assert bitwise_equal(a[name], b[name]), f"step {step}: averaged {name} differs between ranks"
    for name in first["params"]:
        assert bitwise_equal(first["params"][name], second["params"][name]), f"{name} differs between ranks"
    # The ranks had different data, so equal results are not trivially equal inputs.
    assert first["losses"][0] != second["losses"][0]


@pytest.mark.parametrize("scenario", list(worker.EXACT))
@pytest.mark.slow
def test_averaged_gradients_equal_the_independent_simulation(ranks, simulations, scenario):
    """Exact equality (torch.equal: same values, NaN never equal, -0.0 == +0.0). Both sides
    do the same float32 operations in the same order -- acc = g + e, decode, sum in rank
    order, divide -- so no tolerance is needed; any rounding difference is a bug."""
    history, params, residuals = simulations[scenario]
    for step, (recorded, expected) in enumerate(zip(ranks[0]["exact"][scenario]["grads"], history)):
        for name in expected:
            assert recorded[name].dtype == expected[name].dtype
            assert torch.equal(recorded[name], expected[name]), (
                f"step {step}, {name}: max |diff| {(recorded[name].float() - expected[name].float()).abs().max()}"
            )
    for name in params:
        assert torch.equal(ranks[0]["exact"][scenario]["params"][name], params[name]), name
    for rank, result in enumerate(ranks):
        assert sorted(result["exact"][scenario]["residuals"]) == sorted(residuals[rank])
        for name, residual in residuals[rank].items():
            saved = result["exact"][scenario]["residuals"][name]
            assert saved.dtype == torch.float32 and torch.equal(saved, residual), f"rank {rank} residual of {name}"


@pytest.mark.slow
def test_compressed_parameters_really_were_compressed(ranks):
    """The exactness above is not vacuous: each scenario's modes and bytes are what its
    settings say, and the compressed gradients are sparse or quantized."""
    topk = ranks[0]["exact"]["topk"]
    modes = {name: s["mode"] for name, s in topk["stats"]["last_step"]["groups"].items()}
    assert modes == {"0.weight": "allgather", "0.bias": "dense", "2.weight": "dense", "2.bias": "dense"}
    payload = gradcomp.TopK(0.01).layout(worker.D_IN * worker.HIDDEN, torch.float32).nbytes
    dense = 4 * (worker.D_IN * worker.HIDDEN + 2 * worker.HIDDEN + 1)
    assert topk["stats"]["last_step"]["bytes_sent"] == payload + 4 * (2 * worker.HIDDEN + 1)
    assert topk["stats"]["last_step"]["dense_bytes"] == dense
    nonzero = (topk["grads"][-1]["0.weight"] != 0).sum().item()
    assert 0 < nonzero <= 2 * gradcomp.TopK(0.01).k(worker.D_IN * worker.HIDDEN)
    twobit = ranks[0]["exact"]["twobit"]["grads"][-1]["0.weight"]
    t = float(torch.tensor(worker.EXACT["twobit"]["compressor"][1], dtype=torch.float32))
    levels = set(torch.unique(twobit).tolist())
    assert levels <= {-t, -t / 2, 0.0, t / 2, t} and len(levels) >= 3
    global_stats = ranks[0]["exact"]["topk_global"]["stats"]["last_step"]["groups"]
    assert list(global_stats) == ["0.weight+0.bias+2.weight+2.bias"]
    names = [name for name, _ in worker.make_model().named_parameters()]
    assert ranks[0]["exact"]["topk_fp16"]["grad_dtypes"] == dict.fromkeys(names, torch.float16)
    bf16_stats = ranks[0]["exact"]["bf16_allgather"]["stats"]["last_step"]["groups"]
    bf16_modes = {s["mode"] for s in bf16_stats.values()}
    assert bf16_modes == {"allgather"}  # Horovod cannot allreduce bfloat16, so it is gathered


@pytest.mark.slow
def test_checkpoint_resume_is_bitwise_equal_to_an_uninterrupted_run(ranks):
    for result in ranks:
        assert result["checkpoint"]["step_after_load"] == worker.CHECKPOINT_AT
        for name, value in result["checkpoint"]["params"].items():
            assert bitwise_equal(value, result["exact"]["topk"]["params"][name]), name


@pytest.mark.slow
def test_nonfinite_gradient_on_one_rank_leaves_every_residual_unchanged(ranks):
    for result in ranks:
        outcome = result["nonfinite"]
        assert outcome["residual_keys"] == ["0.weight"]
        assert outcome["unchanged"]
        assert not any(outcome["grad_finite"].values())  # every rank sees the NaN in its average
        assert outcome["next_loss_finite"]


# -- the drop-in optimizer against Horovod's own -----------------------------------------
@pytest.mark.parametrize(
    "variant, reference, mode",
    [
        ("identity", "horovod", "dense"),
        ("default", "horovod", "dense"),
        ("topk_all", "horovod", "allgather"),
        ("fp16_dropin", "fp16_stock", "allreduce"),
    ],
)
@pytest.mark.slow
def test_dropin_equals_horovod_distributed_optimizer(ranks, variant, reference, mode):
    """Bitwise equal to Horovod's optimizer after 10 steps. Identity and the default
    compression take Horovod's own in-place allreduce; TopK(1.0) sends every entry
    through the allgather path, and for two ranks Horovod's (g0 + g1) * 0.5 equals our
    (0 + g0 + g1) / 2 in float32. FP16 allreduces in float16 as Compression.fp16 does inside
    hvd.DistributedOptimizer, but scales each rank's gradient by 1/P before the cast (float32)
    where Horovod halves the float16 sum: the two round alike but where a gradient's half falls
    under float16's normal range (6.1e-5), so they agree to float16's rounding, not bitwise."""
    for result in ranks:
        runs = result["equivalence"]
        assert runs[variant]["step_after_broadcast"] == 0  # broadcast_optimizer_state sent nothing
        assert set(runs[variant]["modes"].values()) == {mode}
        for name, value in runs[reference]["params"].items():
            if variant == "fp16_dropin":
                torch.testing.assert_close(runs[variant]["params"][name], value, rtol=2**-10, atol=1e-6)
                continue
            assert bitwise_equal(runs[variant]["params"][name], value), f"{variant}: {name}"
        assert runs[variant]["losses"][-1] < runs[variant]["losses"][0]
    # fp16 rounding does change the result: the pairs above are not all one computation.
    runs = ranks[0]["equivalence"]
    assert not all(bitwise_equal(runs["fp16_stock"]["params"][n], v) for n, v in runs["horovod"]["params"].items())


@pytest.mark.slow
def test_sparse_gradients_follow_horovod(ranks):
    """Sparse embedding gradients: the drop-in uses Horovod's sparse allreduce (bitwise
    Horovod's result) or, with sparse_as_dense=True, compresses the densified gradient;
    either way p.grad is sparse again after synchronize and ranks agree bitwise. The recipe's
    default groups split where a sparse gradient shows; a group the user gave refuses it, as Horovod."""
    first, second = (r["sparse"] for r in ranks)
    for run in (first, second):  # a group the user gave: Horovod's rule, at the first step
        assert "has sparse gradients; pass sparse_as_dense=True" in run.pop("dropin_groups")["error"]
    for name in first:
        assert "error" not in first[name], (name, first[name])
        for param, value in first[name]["params"].items():
            assert bitwise_equal(value, second[name]["params"][param]), f"{name}: {param} differs between ranks"
        assert first[name]["sparse_after_sync"]
        assert first[name]["losses"][-1] < first[name]["losses"][0]
    for param, value in first["horovod"]["params"].items():
        assert bitwise_equal(first["dropin"]["params"][param], value), param
    assert first["dropin"]["modes"]["embedding.weight"] == "sparse"
    assert first["dropin_topk_dense"]["modes"]["embedding.weight"] == "allgather"
    # The recipe's default group held the sparse gradient with the head's: split, the embedding's sparse allreduce
    # alone and the head's two parameters as one group.
    modes = first["dropin_recipe_topk"]["modes"]
    assert modes.pop("embedding.weight") == "sparse" and len(modes) == 1
    assert sorted(next(iter(modes)).split("+")) == ["head.bias", "head.weight"]


# -- convergence -------------------------------------------------------------------------
def final_loss(ranks, method):
    return sum(r["convergence"][method]["losses"][-1] for r in ranks) / len(ranks)


@pytest.mark.slow
def test_stock_fp16_compression_trains_like_dense(ranks):
    dense, fp16 = final_loss(ranks, "dense"), final_loss(ranks, "fp16")
    first = sum(r["convergence"]["fp16"]["losses"][0] for r in ranks) / len(ranks)
    assert fp16 < 0.3 * first
    assert abs(fp16 - dense) <= 0.02 * dense
    # fp16 rounds each averaged gradient to ~3 decimal digits; 200 steps stay close.
    assert max_abs_diff(ranks[0]["convergence"]["fp16"]["params"], ranks[0]["convergence"]["dense"]["params"]) < 5e-3
    assert max_abs_diff(ranks[0]["convergence"]["fp16"]["params"], ranks[0]["convergence"]["dense"]["params"]) > 0


@pytest.mark.slow
def test_topk_with_error_feedback_converges_within_5_percent_of_dense(ranks):
    dense, topk = final_loss(ranks, "dense"), final_loss(ranks, "topk")
    assert dense < 0.3 * sum(r["convergence"]["dense"]["losses"][0] for r in ranks) / len(ranks)
    assert topk <= 1.05 * dense, f"top-k {topk:.5f} vs dense {dense:.5f}"
    stats = ranks[0]["convergence"]["topk"]["stats"]
    assert stats["step"] == worker.CONVERGENCE_STEPS
    assert stats["total"]["compression_ratio"] > 7  # 1% of the 1024-entry weight plus the dense rest


# -- one engine: one checkpoint format and one stats() shape with the DDP hook ---------------
def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key == "residuals":
            assert a[key].keys() == b[key].keys() and a[key]
            assert all(bitwise_equal(a[key][n], b[key][n]) for n in a[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.slow
def test_horovod_and_ddp_load_each_others_checkpoints(ranks):
    for rank, result in enumerate(ranks):
        cross = result["cross_path"]
        assert cross["from_horovod"]["rank"] == rank and cross["from_horovod"]["world_size"] == worker.WORLD_SIZE
        assert cross["from_horovod"]["step"] == 4 and cross["from_ddp"]["step"] == 7
        assert_same_state(cross["loaded_in_ddp"], cross["from_horovod"])
        assert_same_state(cross["loaded_in_horovod"], cross["from_ddp"])
        # The DDP run trained on from the Horovod residuals: they changed, so the round trip is not vacuous.
        assert not all(bitwise_equal(cross["from_ddp"]["residuals"][n], v)
                       for n, v in cross["from_horovod"]["residuals"].items())  # fmt: skip


@pytest.mark.slow
def test_horovod_and_ddp_report_stats_of_one_shape(ranks):
    def shape(value):
        if isinstance(value, dict):
            if value and all(not isinstance(k, str) or "." in k for k in value):  # groups: names vary by path
                return ["group", shape(next(iter(value.values())))]
            return {k: shape(v) for k, v in value.items()}
        return type(value).__name__ if value is not None else "str"  # backend: None when no kernel ran

    stats = ranks[0]["cross_path"]["stats"]
    assert shape(stats["horovod"]) == shape(stats["ddp"])
    assert stats["horovod"]["agreement"]["collectives"] >= 1 and stats["ddp"]["agreement"]["collectives"] >= 1


@pytest.mark.parametrize(
    "name,expected", [("topk", r"compression=TopK\(density=0\.01\)\)$"), ("fp16", r"Compression\.wrap\(FP16\(\)\)")]
)
@pytest.mark.slow
def test_horovods_own_optimizer_refuses_a_gradcomp_compressor_and_names_the_right_call(ranks, name, expected):
    for rank in ranks:
        kind, message = rank["refused"][name]
        assert kind == "TypeError", message
        assert "hvd.DistributedOptimizer(compression=...)" in message
        assert "gradcomp.hooks.horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters()" in message
        assert re.search(expected, message), message


@pytest.mark.parametrize("name,mode", [("two_phase", "two_phase"), ("auto", None)])
@pytest.mark.slow
def test_dropin_takes_exchange_and_policy_as_the_ddp_hook_does(ranks, name, mode):
    first, second = (r["exchange_and_policy"][name] for r in ranks)
    for param in first["params"]:
        assert bitwise_equal(first["params"][param], second["params"][param]), f"{name}: {param} differs"
    assert all(torch.isfinite(torch.tensor(first["losses"])))
    assert first["modes"] == second["modes"] and set(first["modes"]) <= set(exchange_names()), first["modes"]
    if mode is not None:  # groups with fewer elements than ranks fall back to allgather
        assert mode in first["modes"] and set(first["modes"]) <= {mode, "allgather"}, first["modes"]


@pytest.mark.parametrize("exchange", ["allgather", "two_phase"])
@pytest.mark.slow
def test_op_sum_gives_the_average_times_the_world_size_with_every_exchange(ranks, exchange):
    for rank in ranks:
        result = rank["sum_reduction"][exchange]
        for name, average in result["Average"].items():
            assert torch.equal(result["Sum"][name], average * worker.WORLD_SIZE), (exchange, name)


# -- in-process: the compression protocol and argument checks -----------------------------
@pytest.mark.parametrize("compressor", [gradcomp.TopK(0.01), gradcomp.TwoBit(0.5)])
def test_wrapping_a_non_summable_compressor_says_what_to_use(compressor):
    with pytest.raises(TypeError, match=r"gradcomp\.hooks\.horovod\.DistributedOptimizer"):
        gc_hvd.Compression.wrap(compressor)


@pytest.mark.parametrize("compressor", [gradcomp.TopK(0.01), gradcomp.TwoBit(0.5), gradcomp.FP16()], ids=repr)
def test_horovods_own_optimizer_hands_a_gradcomp_compressor_a_refusal(compressor):
    """The guard gradcomp.hooks.horovod puts on hvd.DistributedOptimizer, in-process on a stand-in for
    Horovod's optimizer (test_horovods_own_optimizer_refuses_... runs the real one under horovodrun)."""

    class Stand:
        @staticmethod
        def DistributedOptimizer(optimizer, named_parameters=None, compression=hvd.Compression.none, op=None):
            return compression

    gc_hvd.refuse_gradcomp_compressors(Stand)
    gc_hvd.refuse_gradcomp_compressors(Stand)  # idempotent
    grad = torch.randn(4, 8)
    for given in (compressor, type(compressor)):  # the class by mistake, too
        refusing = Stand.DistributedOptimizer(None, None, given)
        with pytest.raises(TypeError, match=r"horovod\.DistributedOptimizer\(opt, named_parameters=") as error:
            refusing.compress(grad)  # at the first compress call, as Horovod's gradient hook makes it
        assert ("Compression.wrap(FP16())" in str(error.value)) == (given is compressor and compressor.summable)
    assert Stand.DistributedOptimizer(None, compression=gc_hvd.Compression.fp16) is gc_hvd.Compression.fp16
    assert Stand.DistributedOptimizer(None) is hvd.Compression.none
    assert hvd.DistributedOptimizer.refuses_gradcomp_compressors  # installed by importing gradcomp.hooks.horovod
    assert compressor.compress(grad.view(-1)).nbytes == compressor.layout(32, torch.float32).nbytes  # unchanged


def test_fp16_compression_follows_the_horovod_protocol():
    tensor = torch.randn(3, 5, dtype=torch.float32)
    wire, ctx = gc_hvd.Compression.fp16.compress(tensor)
    assert wire.dtype == torch.float16 and wire.shape == tensor.shape
    restored = gc_hvd.Compression.fp16.decompress(wire, ctx)
    assert restored.dtype == torch.float32 and torch.equal(restored, tensor.half().float())
    # An out-of-place result (hvd.allreduce) decodes the same way.
    assert torch.equal(gc_hvd.Compression.fp16.decompress(wire.clone() * 2, ctx), tensor.half().float() * 2)
    integers = torch.arange(4)
    assert gc_hvd.Compression.fp16.compress(integers) == (integers, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_casts_compression_sends_and_returns_its_payloads_values(dtype):
    """A cast through Horovod is one conversion each way: the values, dtype and contiguity the cast's own payload
    and decode give, for a strided gradient too."""
    tensor = torch.randn(6, 5, dtype=dtype).t()
    wire, ctx = gc_hvd.Compression.fp16.compress(tensor)
    payload = gradcomp.FP16().compress(tensor.reshape(-1))
    assert wire.is_contiguous() and wire.shape == tensor.shape and torch.equal(wire.view(-1), payload["data"])
    reduced = wire * 2  # an out-of-place allreduce's result
    out = torch.empty(tensor.numel(), dtype=dtype)
    gradcomp.FP16().decompress(_payload_of(reduced), out)
    restored = gc_hvd.Compression.fp16.decompress(reduced, ctx)
    assert restored.dtype == dtype and restored.shape == tensor.shape and torch.equal(restored.reshape(-1), out)


def _payload_of(data: torch.Tensor):
    """An fp16 payload holding ``data``'s values (float16)."""
    payload = gradcomp.FP16().layout(data.numel(), torch.float32).allocate(data.device)
    payload["data"].copy_(data.reshape(-1))
    return payload


def test_bf16_compression_works_or_says_why_not():
    """Horovod 0.28.1 has no bfloat16 allreduce in its torch bindings; Compression.bf16
    must then fail at once with a message naming the alternatives."""
    tensor = torch.randn(8)
    if gc_hvd.horovod_can_allreduce(torch.bfloat16, tensor.device):
        wire, ctx = gc_hvd.Compression.bf16.compress(tensor)
        assert wire.dtype == torch.bfloat16
        assert torch.equal(gc_hvd.Compression.bf16.decompress(wire, ctx), tensor.bfloat16().float())
    else:
        assert horovod.__version__ == "0.28.1"  # a newer Horovod should be checked, not assumed
        expected = r"cannot allreduce torch\.bfloat16.*Compression\.fp16.*DistributedOptimizer"
        with pytest.raises(TypeError, match=expected):
            gc_hvd.Compression.bf16.compress(tensor)


def test_dropin_argument_errors_say_how_to_fix_them():
    model = worker.make_model()
    sgd = worker.make_sgd(model)
    with pytest.raises(ValueError, match="named_parameters=model.named_parameters()"):
        gc_hvd.DistributedOptimizer(sgd, compression=gradcomp.TopK(0.01))
    with pytest.raises(ValueError, match=r"^op=hvd\.Adasum cannot combine.*op=hvd\.Average"):
        gc_hvd.DistributedOptimizer(sgd, model.named_parameters(), gradcomp.TwoBit(0.5), op=hvd.Adasum)
    with pytest.raises(TypeError, match="instance"):
        gc_hvd.DistributedOptimizer(sgd, model.named_parameters(), gradcomp.TopK)
    with pytest.raises(ValueError, match="min_numel"):
        gc_hvd.DistributedOptimizer(sgd, model.named_parameters(), gradcomp.TopK(0.01), min_numel=-1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        gc_hvd.DistributedOptimizer(sgd, model.named_parameters(), gradcomp.TopK(0.01), backward_passes_per_step=0)


def test_dropin_fails_at_construction_for_bad_backends_and_dtypes(monkeypatch):
    """Before any training step (and before Horovod's first collective)."""
    model = worker.make_model()
    with pytest.raises(ValueError, match="backend"):
        gc_hvd.DistributedOptimizer(worker.make_sgd(model), model.named_parameters(), gradcomp.TopK(0.01),
                                    backend="opencl")  # fmt: skip
    monkeypatch.setenv("GRADCOMP_BACKEND", "opencl")
    with pytest.raises(ValueError, match="GRADCOMP_BACKEND"):
        gc_hvd.DistributedOptimizer(worker.make_sgd(model), model.named_parameters(), gradcomp.TopK(0.01))
    monkeypatch.delenv("GRADCOMP_BACKEND")
    doubled = worker.make_model(torch.float64)
    with pytest.raises(TypeError, match="float64"):
        gc_hvd.DistributedOptimizer(worker.make_sgd(doubled), doubled.named_parameters(), gradcomp.TwoBit(0.5))


def test_the_recipes_default_groups_are_the_buckets_ddp_exchanges(tmp_path):
    """Without ``groups=`` the recipe under Horovod exchanges what DDP's buckets hold once DDP has seen a step
    (recorded by a comm hook on a one-rank Gloo group): reverse order, a bucket per dtype, the first closed at
    1 MiB and the rest at 25 MiB (one float64 layer makes a second dtype)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp.hooks.horovod.parameters import ddp_buckets

    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.single = torch.nn.Sequential(torch.nn.Linear(64, 2700), torch.nn.Linear(2700, 2700),
                                              torch.nn.Linear(2700, 100))
            self.wide = torch.nn.Sequential(torch.nn.Linear(100, 1000), torch.nn.Linear(1000, 300)).double()

        def forward(self, x):
            return self.wide(self.single(x).double())

    torch.manual_seed(0)
    model = Mixed()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp, seen = DistributedDataParallel(model), []

        def record(state, bucket):
            seen.append([id(p) for p in bucket.parameters()])
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        ddp.register_comm_hook(None, record)
        for _ in range(2):  # the buckets are rebuilt in gradient order after the first step
            seen.clear()
            ddp(torch.randn(4, 64)).pow(2).mean().backward()
    finally:
        dist.destroy_process_group()
    buckets = [[id(p) for p in bucket] for bucket in ddp_buckets(list(model.parameters()))]
    assert sorted(buckets) == sorted(seen) and len(buckets) == 5  # 3 closed (1 MiB twice, 25 MiB), 2 open


# -- the build script ----------------------------------------------------------------------
def test_build_script_is_a_quick_no_op_when_horovod_is_installed():
    started = time.monotonic()
    proc = subprocess.run(["bash", str(REPO / "scripts" / "build_horovod.sh")], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHON=sys.executable))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout
    assert time.monotonic() - started < 60
