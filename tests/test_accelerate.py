"""gradcomp under Accelerate: ``accelerate launch`` on 2 CPU processes (real Accelerate, real Gloo).

The script (tests/accelerate_train.py) is the hand-written recipe loop of
``framework_workers.recipe_hand_written`` in Accelerate's words: ``prepare``, ``accumulate``,
``backward``, ``clip_grad_norm_``, the prepared optimizer and scheduler, ``save_state``/``load_state``.
"""
import pytest
import torch

import framework_workers as fw
import launchers
import multiprocess
import readme_worker

pytest.importorskip("accelerate", reason="needs accelerate: pip install 'gradcomp[frameworks]'")

pytestmark = pytest.mark.multiprocess

SPECS = ["topk:0.1", "twobit:chunk"]
STEPS, ACCUMULATE, SAVE_AT = 8, 2, 4
# The warm-up peaks at optimizer step RECIPE_WARMUP - 1; read at Accelerate's pace (2 scheduler steps per
# optimizer step) it would end later and the byte budget would cap the dense start elsewhere.
DENSE_STEPS = fw.RECIPE_WARMUP - 1


def run_accelerate(tmp_path, spec, name, *extra):
    out = tmp_path / f"{name}.pt"
    launchers.accelerate_launch("accelerate_train.py", [spec, str(STEPS), str(ACCUMULATE), str(out), *extra], tmp_path)
    return torch.load(out, weights_only=False)


def check_accumulation(records):
    """Per micro-batch: only the last of each optimizer step synchronises; the hook's step counts
    optimizer steps; gradcomp's state is untouched by the others and changed by the synchronising one."""
    assert len(records) == (STEPS - SAVE_AT) * ACCUMULATE or len(records) == STEPS * ACCUMULATE
    for index, record in enumerate(records):
        assert record["synced"] == (index % ACCUMULATE == ACCUMULATE - 1), index
        if not record["synced"]:
            assert record["unchanged"], index
    steps = [r["engine_step"] for r in records if r["synced"]]
    assert steps == list(range(STEPS - len(steps) + 1, STEPS + 1))
    assert not any(r["unchanged"] for r in records if r["synced"])  # so the check above could fail


# Every `accelerate launch` job is slow (two launches and a spawn: about 15 s on two idle cores); the quick
# selection keeps test_accelerate_register_refuses_a_model_without_ddp, in-process.
@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_accelerate_recipe_with_accumulation_matches_hand_written_ddp_and_resumes_bitwise(tmp_path, spec):
    checkpoint = tmp_path / "state"
    straight = run_accelerate(tmp_path, spec, "straight", "--save-at", str(SAVE_AT), str(checkpoint))
    hand = multiprocess.spawn(fw.recipe_hand_written, 2, str(tmp_path), spec, STEPS, ACCUMULATE)[0]
    assert straight["world"] == 2
    assert straight["dense_steps"] == hand["dense_steps"] == DENSE_STEPS
    assert straight["step"] == hand["step"] == STEPS
    assert straight["stats"]["compression_ratio"] > 1.3  # compressed after the dense start
    assert straight["stats"]["bytes_sent"] == hand["stats"]["bytes_sent"]
    check_accumulation(straight["records"])
    # Same data, seed and DDP buckets: the same computation, so equal bit for bit.
    for name, value in hand["params"].items():
        assert torch.equal(straight["params"][name], value), name
    assert abs(straight["held_out"] - hand["held_out"]) <= 0.01 * hand["held_out"]

    resumed = run_accelerate(tmp_path, spec, "resumed", "--resume", str(checkpoint), str(SAVE_AT))
    assert resumed["step"] == STEPS
    check_accumulation(resumed["records"])
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name
    # Telemetry totals continue across the resume.
    assert resumed["stats"]["bytes_sent"] == straight["stats"]["bytes_sent"]


def test_accelerate_register_refuses_a_model_without_ddp():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from gradcomp.hooks import accelerate as gc_accelerate

    accelerator = Accelerator(cpu=True)  # one process: prepare leaves the model as it is
    try:
        model = accelerator.prepare(torch.nn.Linear(4, 4))
        with pytest.raises(TypeError, match="DistributedDataParallel model that accelerator.prepare returns"):
            gc_accelerate.register(accelerator, model, "topk:0.1")
    finally:
        AcceleratorState._reset_state(True)  # Accelerate's state is per process: leave none to later tests


# What an Accelerate script has before the README's lines, and what the test checks after them.
README_PREAMBLE = """
import os

import torch

import ddp_workers as workers

torch.set_num_threads(1)
model = workers.make_model("mlp")
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
loss_fn = torch.nn.functional.mse_loss
loader = [workers.batch(int(os.environ["RANK"]), i) for i in range(16)]
"""
README_CHECKS = """
assert accelerator.num_processes == 2, accelerator.distributed_type
assert state.step == 8 and state.stats()["total"]["compression_ratio"] > 1.3, state.stats()
accelerator.wait_for_everyone()  # save_state has no barrier: the main process writes the file
assert os.path.isfile("checkpoint/custom_checkpoint_0.pkl")
"""


@pytest.mark.slow
def test_accelerate_readme_example_runs_under_accelerate_launch(tmp_path):
    script = launchers.script_with(tmp_path / "readme_accelerate.py", README_PREAMBLE,
                                   readme_worker.example("accelerate"), README_CHECKS)  # fmt: skip
    launchers.accelerate_launch(str(script), [], tmp_path)
