"""gradcomp's hook on compiled models: ``DDP(torch.compile(net))`` and ``torch.compile(DDP(net))`` with
the one-call recipe, on 2 Gloo ranks, against the same loop on the eager model.

torch 2.13 compiles a DDP model with ``optimize_ddp="ddp_optimizer"`` (the default): Dynamo splits the
graph at bucket boundaries and DDP's own reducer runs the hook on each bucket, as in eager mode.
Compiled autograd is off by default; DDP under it (``optimize_ddp="python_reducer"``) calls comm hooks
per parameter without a bucket, so ``register`` refuses such a model with what to do instead.
"""
import pytest

import compile_workers
import framework_workers as fw
import multiprocess

pytestmark = pytest.mark.multiprocess

STEPS = 8
# aot_eager: Dynamo's graph splitting at buckets and AOTAutograd's compiled backward, without the
# C++ build of inductor's kernels (minutes on two shared cores); inductor itself runs in the slow cases.
CASES = [("compiled_module", "aot_eager", "topk:0.1"), ("compiled_ddp", "aot_eager", "topk:0.1"),
         ("compiled_ddp", "aot_eager", "twobit:chunk"), ("compiled_module", "inductor", "topk:0.1"),
         ("compiled_ddp", "inductor", "twobit:chunk")]


# Two 2-rank runs, one compiling, per case: slow. The quick run keeps the refusal below (one rank).
@pytest.mark.slow
@pytest.mark.parametrize("mode,backend,spec", CASES)
def test_torch_compile_recipe_matches_eager(tmp_path, mode, backend, spec):
    (tmp_path / "e").mkdir()
    (tmp_path / "c").mkdir()
    eager = multiprocess.spawn(compile_workers.recipe_loop, 2, str(tmp_path / "e"), spec, STEPS, "eager",
                               timeout_s=300)[0]  # fmt: skip
    compiled = multiprocess.spawn(compile_workers.recipe_loop, 2, str(tmp_path / "c"), spec, STEPS, mode, backend,
                                  timeout_s=600)[0]  # fmt: skip
    # The hook ran on every step of the compiled model, and compressed after the same dense start.
    assert compiled["stats"]["steps"] == eager["stats"]["steps"] == STEPS
    assert compiled["dense_steps"] == eager["dense_steps"] == fw.RECIPE_WARMUP - 1
    assert compiled["stats"]["bytes_sent"] == eager["stats"]["bytes_sent"]
    assert compiled["stats"]["compression_ratio"] > 1.3
    assert abs(compiled["held_out"] - eager["held_out"]) <= 0.01 * eager["held_out"]


def test_torch_compile_python_reducer_is_refused_with_what_to_do(tmp_path):
    message = multiprocess.spawn(compile_workers.python_reducer_refused, 1, str(tmp_path))[0]
    assert message is not None and "python_reducer" in message and "ddp_optimizer" in message
