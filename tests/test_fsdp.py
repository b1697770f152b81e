"""gradcomp as FSDP2's reduce-scatter (``gradcomp.hooks.fsdp``) on 2 and 4 real Gloo ranks (``-k fsdp``).

A small transformer-shaped model with nested ``fully_shard`` modules and unevenly padded shards
(``fsdp_workers.py``) trains on every rank; each rank returns every step's averaged ``.grad`` and the
final parameters, gathered whole. They must equal, bit for bit, an independent simulation of the ranks
(``fsdp_workers.simulate``); with ``Identity`` (and on dense steps) FSDP's own reduce-scatter.
"""
import pytest
import torch

import fsdp_workers as workers
import multiprocess
from fsdp_simulation import local_gradients, simulate


def assert_same(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        assert torch.equal(actual[name], expected[name]), (
            f"{what}: {name} differs by up to {(actual[name] - expected[name]).abs().max():.3g}")


def assert_run_matches(results, expected, what: str) -> None:
    """Every rank's gathered gradients of every step and final parameters equal ``expected``'s."""
    for rank, result in enumerate(results):
        assert len(result["grads"]) == len(expected["grads"]), what
        for step, (grads, wanted) in enumerate(zip(result["grads"], expected["grads"])):
            assert_same(grads, wanted, f"{what}, rank {rank}, step {step}")
        assert_same(result["params"], expected["params"], f"{what}, rank {rank}, final parameters")


@pytest.mark.multiprocess
def test_fsdp_quick_topk_matches_the_simulation_identity_is_fsdps_own_and_adam_is_refused(tmp_path):
    results = multiprocess.spawn(workers.quick, 2, str(tmp_path), timeout_s=400)
    case = {"spec": "topk:0.2", "steps": 3, "dense_at": (1,), "momentum": 0.9}
    assert_run_matches([r["topk"] for r in results], simulate(2, case), "top-k")
    modes = {group["mode"] for group in results[0]["topk"]["stats"]["last_step"]["groups"].values()}
    assert modes == {"reduce_scatter"}
    assert_run_matches([r["identity"] for r in results], results[0]["fsdp"], "Identity against FSDP's own")
    refusal = results[0]["adam_refusal"]
    assert refusal is not None and "cannot run under FSDP" in refusal and "without optimizer=" in refusal, refusal


#: (ranks, case) against the simulation; all compress from the first step (a dense step's sum over 4 ranks
#: is Gloo's order, which the simulation does not follow; the quick case has one at 2 ranks).
MATRIX = [
    (2, {"spec": "twobit:chunk", "steps": 4, "dense_at": (2,), "momentum": 0.9}),
    (4, {"spec": "topk:0.2", "steps": 3, "momentum": 0.9}),
    (4, {"spec": "twobit:chunk", "steps": 3, "momentum": 0.9}),
    (2, {"spec": "topk:0.2", "steps": 3, "residual_dtype": "bfloat16"}),
    (2, {"spec": "twobit:chunk", "steps": 3, "residual_dtype": "bfloat16"}),
    (2, {"spec": "topk:0.2", "steps": 3, "residual_share": 0.5}),
    (2, {"spec": "topk:0.2", "steps": 3, "granularity": "bucket"}),
    (2, {"spec": "topk:0.2", "steps": 3, "backend": "numba"}),
    (2, {"spec": "topk:0.1", "steps": 5, "recipe": True, "momentum": 0.9, "warmup": 2, "clip": 100.0}),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size,case", MATRIX, ids=lambda v: str(v) if isinstance(v, int) else "-".join(
    f"{k}={w}" for k, w in v.items() if k in ("spec", "residual_dtype", "residual_share", "granularity", "backend",
                                              "recipe")))
def test_fsdp_compressed_reduce_scatter_matches_the_simulation(tmp_path, world_size, case):
    """Every step's averaged .grad and the final parameters, gathered on every rank, bitwise the independent
    simulation; the recipe's case (SGD with momentum, an LR warm-up, clip_grad_norm_ on the DTensors) runs the
    compressors its schedule chose and the norm the clip measured is the simulation's."""
    if case.get("backend") == "numba":
        pytest.importorskip("numba")
    results = multiprocess.spawn(workers.train, world_size, str(tmp_path), case, timeout_s=600)
    specs = results[0]["specs"] if case.get("recipe") else None
    expected = simulate(world_size, case, specs)
    assert_run_matches(results, expected, str(case))
    if case.get("recipe"):
        assert specs[0] is None and specs[-1] == "topk:0.2,entries=compact", specs  # dense, then the recipe's top-k
        for result in results:
            assert result["norms"] == pytest.approx(expected["norms"], rel=1e-6)
    if case.get("residual_dtype") == "bfloat16":
        held = results[0]["residuals"]["residuals"]
        assert held and all(t.dtype == torch.bfloat16 for t in held.values())


def test_fsdp_residual_options_keep_what_they_say():
    """The bytes a rank keeps between steps for each residual option, from the pieces of the model."""
    from gradcomp.compact_residuals import CompactResiduals

    for storage, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        memory = CompactResiduals(storage, min_numel=10)
        e, spare = memory.buffers(["w[0/2]", "b[0/2]"], [30, 5], "cpu")
        spare.copy_(torch.arange(35.0) / 7)
        memory.commit(["w[0/2]", "b[0/2]"], True)
        assert memory.keys() == ["w[0/2]"] and memory.nbytes() == 30 * size  # the 5-element piece keeps none
        assert torch.equal(memory.residual("w[0/2]"), (torch.arange(30.0) / 7).to(storage))
        e, spare = memory.buffers(["w[0/2]", "b[0/2]"], [30, 5], "cpu")
        assert torch.equal(e[:30], (torch.arange(30.0) / 7).to(storage).float()) and not e[30:].any()
        spare.fill_(1.0)
        memory.commit(["w[0/2]", "b[0/2]"], torch.tensor(False))  # a non-finite step commits nothing
        assert torch.equal(memory.residual("w[0/2]"), (torch.arange(30.0) / 7).to(storage))
        e, spare = memory.buffers(["w[0/2]", "b[0/2]"], [30, 5], "cpu")
        spare.fill_(2.0)
        memory.commit(["w[0/2]", "b[0/2]"], True, decay=0.75)  # the engine's residual_decay
        assert torch.equal(memory.residual("w[0/2]"), torch.full((30,), 1.5).to(storage))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_identity_is_fsdps_own_reduce_scatter_and_the_lossless_compressed_path_its_average(tmp_path,
                                                                                               world_size):
    """Identity goes through FSDP's own reduce-scatter: bitwise. Top-k of every entry goes through the
    compressed path (values and indices, the all-to-all, the rank-ordered float32 sum, / P): bitwise at 2
    ranks, where a + b is one rounding in any order. At 4 ranks Gloo adds in an order of its own; two
    orders of a sum of P terms differ by at most (P - 1) eps sum_r |g_r| (to first order), and / P is
    exact, so at the first step, from the same parameters: |d| <= (P - 1) eps sum_r |g_r| / P."""
    results = multiprocess.spawn(workers.lossless, world_size, str(tmp_path), timeout_s=600)
    local = local_gradients(world_size, step=0)
    eps = torch.finfo(torch.float32).eps
    for rank, result in enumerate(results):
        assert_run_matches([result["identity"]], result["fsdp"], f"Identity, rank {rank}")
        if world_size == 2:
            assert_run_matches([result["topk_all"]], result["fsdp"], f"top-k of every entry, rank {rank}")
            continue
        mine, theirs = result["topk_all"]["grads"][0], result["fsdp"]["grads"][0]
        for name in theirs:
            bound = (world_size - 1) * eps * sum(g[name].abs() for g in local) / world_size
            assert ((mine[name] - theirs[name]).abs() <= bound).all(), f"rank {rank}, {name}"
        assert result["topk_all"]["stats"]["last_step"]["groups"]["<root>"]["mode"] == "reduce_scatter"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [
    {"spec": "topk:0.2", "steps": 5, "split": 2, "momentum": 0.9},
    {"spec": "twobit:chunk", "steps": 5, "split": 3, "momentum": 0.9, "residual_dtype": "bfloat16"},
], ids=["topk", "twobit-bf16"])
def test_fsdp_resume_through_distributed_checkpoint_is_bitwise(tmp_path, case):
    results = multiprocess.spawn(workers.resume, 2, str(tmp_path), case, timeout_s=600, pass_out_dir=True)
    for rank, result in enumerate(results):
        assert result["step_at_load"] == case["split"], result["step_at_load"]
        assert len(result["resumed"]["grads"]) == case["steps"] - case["split"]
        for step, (a, b) in enumerate(zip(result["straight"]["grads"], result["resumed"]["grads"])):
            assert_same(b, a, f"rank {rank}, step {case['split'] + step} after the resume")
        assert_same(result["params"][1], result["params"][0], f"rank {rank}, final parameters")
        assert_same(result["residuals"][1], result["residuals"][0], f"rank {rank}, final residuals")
        assert result["residuals"][0], "no residuals were kept"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_a_hostile_chunk_gives_every_rank_the_same_clear_error(tmp_path):
    results, codes = multiprocess.spawn(workers.hostile, 2, str(tmp_path), timeout_s=400, pg_timeout_s=60,
                                        check=False, pass_out_dir=True)
    assert codes == [0, 0], multiprocess.failure_report(workers.hostile, codes, str(tmp_path), 400)
    assert results[1]["corrupted"] == 1
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank}: the corrupt payload was accepted"
        assert "gradcomp: rejected the payload sent by rank 1: its payload for rank 0 failed validation" in error, (
            error[-2000:])
        assert "group 'blocks.1.mlp', reduce-scatter" in error, error[-2000:]
        assert_same(result["after"], result["before"], f"rank {rank}: residuals after the rejected step")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_fsdp_a_non_finite_average_on_one_rank_commits_nothing_on_any(tmp_path):
    results = multiprocess.spawn(workers.poisoned, 2, str(tmp_path), timeout_s=400)
    assert not all(torch.isfinite(t).all() for t in results[1]["shard"].values())
    assert all(torch.isfinite(t).all() for t in results[0]["shard"].values())  # rank 0's own average is finite
    for rank, result in enumerate(results):
        poisoned = {k: v for k, v in result["before"].items() if k.startswith("blocks.1.mlp.")}
        assert poisoned and all(torch.equal(result["after"][k], v) for k, v in poisoned.items()), rank
        others = [k for k in result["before"] if k.startswith("blocks.0.mlp.")]
        assert others and any(not torch.equal(result["after"][k], result["before"][k]) for k in others), rank
