"""gradcomp under the Hugging Face ``Trainer``: a one-layer GPT-2 built from a config, trained by the
Trainer on 2 CPU ranks (``torchrun``, real Accelerate underneath, real Gloo) with
``GradcompTrainerCallback`` and the Trainer's own optimizer, scheduler, clipping and accumulation."""
import pytest
import torch

import hf_workers as hf
import launchers
import multiprocess
import readme_worker

pytest.importorskip("transformers", reason="needs transformers: pip install 'gradcomp[test]'")

pytestmark = pytest.mark.multiprocess

SPECS = ["topk:0.1", "twobit:chunk"]


def run_trainer(tmp_path, spec, name, *extra):
    result = tmp_path / f"{name}.pt"
    launchers.torchrun("hf_trainer_train.py", [spec, str(tmp_path / name), str(result), *extra], tmp_path)
    return torch.load(result, weights_only=False)


# Two torchrun jobs and a spawn each; the quick run keeps the README example, one torchrun job.
@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS)
def test_hf_trainer_recipe_matches_hand_written_ddp_and_resumes_bitwise(tmp_path, spec):
    straight = run_trainer(tmp_path, spec, "straight")
    hand = multiprocess.spawn(hf.recipe_hand_written, 2, str(tmp_path), spec)[0]
    # What the hand-written loop assumes of the Trainer.
    assert straight["world"] == 2 and straight["ddp"] == "DistributedDataParallel"
    assert straight["accepts_loss_kwargs"] and straight["mixed_precision"] == "no"
    assert straight["optimizer_class"] == "AdamW" and straight["optimizer_groups"] == hand["optimizer_groups"]
    # The recipe read the Trainer's run: its length, its warm-up (the scheduler's peak), its optimizer.
    assert straight["step"] == hand["step"] == hf.STEPS
    assert straight["dense_steps"] == hand["dense_steps"] == hf.WARMUP
    assert straight["stats"]["compression_ratio"] > 1.3
    assert abs(straight["held_out"] - hand["held_out"]) <= 0.01 * hand["held_out"]
    # Resumed from the Trainer's own checkpoint at step SAVE_AT (gradcomp.pt beside optimizer.pt).
    checkpoint = tmp_path / "straight" / f"checkpoint-{hf.SAVE_AT}"
    saved = torch.load(checkpoint / "gradcomp.pt", weights_only=True)
    assert len(saved["ranks"]) == 2
    resumed = run_trainer(tmp_path, spec, "resumed", "--resume", str(checkpoint))
    assert resumed["step"] == hf.STEPS
    assert resumed["stats"]["bytes_sent"] == straight["stats"]["bytes_sent"]
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.slow
def test_hf_trainer_compressed_against_dense(tmp_path):
    dense = run_trainer(tmp_path, "dense", "dense")
    hand_dense = multiprocess.spawn(hf.recipe_hand_written, 2, str(tmp_path), None)[0]
    compressed = run_trainer(tmp_path, "topk:0.1", "topk")
    assert dense["stats"] is None  # no callback: the Trainer's own DDP allreduce
    assert abs(dense["held_out"] - hand_dense["held_out"]) <= 0.01 * hand_dense["held_out"]
    initial = hf.held_out(hf.make_model())
    assert compressed["held_out"] < initial  # it trained
    assert abs(compressed["held_out"] - dense["held_out"]) <= 0.05 * dense["held_out"]


README_PREAMBLE = """
import os

import torch
from transformers import TrainingArguments

import hf_workers as hf

torch.set_num_threads(1)
model = hf.make_model()
args = TrainingArguments(output_dir="out", use_cpu=True, per_device_train_batch_size=hf.BATCH, max_steps=8,
                         save_steps=4, report_to="none", disable_tqdm=True, train_sampling_strategy="sequential")
train_dataset = hf.train_items(2)
"""
README_CHECKS = """
callback = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "GradcompTrainerCallback")
assert callback.state.step == 8 and callback.state.stats()["total"]["compression_ratio"] > 1.3
trainer.accelerator.wait_for_everyone()  # the main process writes the files, with no barrier after
assert os.path.isfile("out/checkpoint-4/gradcomp.pt") and os.path.isfile("out/checkpoint-8/gradcomp.pt")
"""


def test_hf_trainer_readme_example_runs_under_torchrun(tmp_path):
    script = launchers.script_with(tmp_path / "readme_hf_trainer.py", README_PREAMBLE,
                                   readme_worker.example("hf_trainer"), README_CHECKS)  # fmt: skip
    launchers.torchrun(str(script), [], tmp_path)
