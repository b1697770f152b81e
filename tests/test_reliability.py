"""Hardened state handling: non-finite steps, checkpoint/resume, mixed precision, DDP
modes, dying ranks, scale limits. Real Gloo processes, no mocks."""
import math

import pytest
import torch

import gradcomp
import reliability_workers as rw
from multiprocess import spawn

SPECS = [("topk", 0.01), ("twobit", 0.02)]


def assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


# Every test on real ranks here is slow; the quick run keeps the in-process size limits at the end.
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_non_finite_step_on_one_rank_is_skipped_everywhere_and_forgotten(tmp_path, spec):
    with_bad = [(0, False), (1, False), (2, False), (3, True), (3, False), (4, False), (5, False)]
    clean = [(0, False), (1, False), (2, False), (3, False), (4, False), (5, False)]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    poisoned = spawn(rw.nonfinite_run, 2, str(tmp_path / "a"), spec, with_bad, 1)
    reference = spawn(rw.nonfinite_run, 2, str(tmp_path / "b"), spec, clean, 1)
    for rank in range(2):
        assert poisoned[rank]["finite_at_bad_step"] is False, f"rank {rank} saw a finite average"
        before, after = poisoned[rank]["residuals_before"], poisoned[rank]["residuals_after"]
        assert before, "residuals should exist before the bad step"
        assert_same(after, before, f"rank {rank} residuals changed by the bad step")
        assert_same(poisoned[rank]["params"], reference[rank]["params"], f"rank {rank} trajectory")


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,model_kind,ddp_kwargs",
    [(("topk", 0.01), "mlp", {}), (("twobit", 0.02), "shuffled", {"bucket_cap_mb": 0.001})],
    ids=["topk-one-bucket", "twobit-several-buckets"],
)
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run_bitwise(tmp_path, spec, model_kind, ddp_kwargs):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (tmp_path / "full").mkdir(), (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir()
    full = spawn(rw.checkpoint_run, 2, str(tmp_path / "full"), spec, model_kind, ddp_kwargs, 0, 16, str(ckpt))
    spawn(rw.checkpoint_run, 2, str(tmp_path / "first"), spec, model_kind, ddp_kwargs, 0, 8, str(ckpt), 8)
    resumed = spawn(rw.checkpoint_run, 2, str(tmp_path / "second"), spec, model_kind, ddp_kwargs, 8, 16, str(ckpt))
    for rank in range(2):
        assert resumed[rank]["warnings"] == []
        assert resumed[rank]["step"] == full[rank]["step"] == 16
        assert_same(resumed[rank]["params"], full[rank]["params"], f"rank {rank} after resume")
    # A different world size: residuals are reset with a warning, training goes on.
    (tmp_path / "third").mkdir()
    grown = spawn(rw.checkpoint_run, 3, str(tmp_path / "third"), spec, model_kind, ddp_kwargs, 8, 10, str(ckpt))
    for result in grown:
        assert any("world size 2" in w and "reset" in w for w in result["warnings"]), result["warnings"]
        assert all(torch.isfinite(p).all() for p in result["params"].values())


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_and_bfloat16_gradients_keep_float32_residuals_for_every_compressor(tmp_path, dtype):
    specs = [("topk", 0.05), ("twobit", 0.02), ("identity", None), ("fp16", None)]
    results = spawn(rw.mixed_precision_run, 2, str(tmp_path), dtype, specs, 6)
    for spec in specs:
        first, second = results[0][spec], results[1][spec]
        assert first["grad_dtypes"] == {str(dtype)}
        if spec[0] in ("topk", "twobit"):
            assert first["residual_dtypes"] == {"torch.float32"}
        assert_same(first["params"], second["params"], f"{spec} ranks")
        assert all(math.isfinite(v) for v in first["losses"])
        assert first["losses"][-1] < first["losses"][0], f"{spec} did not learn: {first['losses']}"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["no_sync", "static_graph", "unused"])
def test_ddp_modes_no_sync_static_graph_and_unused_parameters(tmp_path, mode):
    specs = [None, ("identity", None), ("twobit", 0.02), ("topk", 0.05)]
    results = spawn(rw.ddp_modes_run, 2, str(tmp_path), mode, specs, 4)
    for rank in range(2):
        builtin, identity = results[rank]["None"]["grads"], results[rank][str(("identity", None))]["grads"]
        for step, (a, b) in enumerate(zip(identity, builtin)):
            assert_same(a, b, f"{mode} identity vs built-in, step {step}")
    for spec in specs[2:]:
        assert_same(results[0][str(spec)]["params"], results[1][str(spec)]["params"], f"{mode} {spec} ranks")
        if mode == "unused":
            grads = results[0][str(spec)]["grads"][-1]
            assert "unused.weight" not in grads or torch.count_nonzero(grads["unused.weight"]) == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_dying_rank_makes_the_others_fail_with_a_clear_error_not_hang(tmp_path):
    results, codes = spawn(
        rw.dying_rank_run, 2, str(tmp_path), ("topk", 0.01), 3, pg_timeout_s=10, timeout_s=90, check=False
    )
    assert codes[1] == 3
    survivor = results[0]
    assert survivor is not None and survivor["error"] is not None, "rank 0 did not notice the dead peer"
    assert "gradcomp" in survivor["error"] and "peer rank" in survivor["error"], survivor["error"]
    assert survivor["seconds"] < 30
    assert codes[0] == 0


# -- scale limits and degenerate sizes (no processes) --------------------------------------------
@pytest.mark.parametrize(
    "compressor", [gradcomp.TopK(0.01), gradcomp.TwoBit(0.5), gradcomp.Identity(), gradcomp.FP16()], ids=repr
)
def test_empty_tensors_compress_to_an_empty_payload(compressor):
    empty = torch.zeros(0)
    payload = compressor.compress(empty, torch.zeros(0), torch.zeros(0))
    out = torch.zeros(0)
    compressor.decompress_add(payload, out)
    assert payload.nbytes == 8 and out.numel() == 0


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_tensors_smaller_than_k_send_everything(n):
    compressor = gradcomp.TopK(0.9)
    grad = torch.randn(n)
    payload = compressor.compress(grad, torch.zeros(n), residual_out := torch.empty(n))
    assert payload["indices"].numel() == compressor.k(n) <= n
    out = torch.zeros(n)
    compressor.decompress_add(payload, out)
    assert torch.equal(out + residual_out, grad)


@pytest.mark.slow  # 12 GiB touched on one core: minutes
def test_a_tensor_of_more_than_2_31_elements_uses_int64_indices_end_to_end():
    # One real tensor past int32's range (4 GiB of fp16, 8 GiB of fp32 output): the
    # index width, the offsets and the scatter back must all be 64-bit.
    n = 2**31 + 16
    grad = torch.zeros(n, dtype=torch.float16)
    grad[3], grad[2**31 - 2], grad[2**31 + 5] = -9.0, 5.0, 7.0
    compressor = gradcomp.TopK(1e-9)  # k = 3
    payload = compressor.compress(grad)
    del grad
    assert payload["indices"].dtype == torch.int64
    assert payload["indices"].tolist() == [3, 2**31 - 2, 2**31 + 5]
    assert payload["values"].tolist() == [-9.0, 5.0, 7.0]
    out = torch.zeros(n)
    compressor.decompress_add(payload, out)
    assert out[2**31 + 5].item() == 7.0 and out[2**31 - 2].item() == 5.0 and out[3].item() == -9.0
    assert out.abs().sum().item() == 21.0
