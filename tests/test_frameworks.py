"""gradcomp inside the frameworks users train with: Lightning (its own ``ddp`` launcher, 2 CPU
ranks) and plain DDP gradient accumulation with ``no_sync``. Real processes, real Gloo."""
import os
import subprocess
import sys

import pytest
import torch

import framework_workers
import multiprocess

HERE = os.path.dirname(os.path.abspath(__file__))
SPECS = [("topk", 0.1), ("twobit", 0.01)]
# Every job here (a Lightning run starts 2 ranks that import Lightning) is slow; the quick selection keeps
# test_lightning_readme_example_builds_a_trainer_with_the_callback, in-process.


def _spec_text(spec):
    return spec if isinstance(spec, str) else f"{spec[0]}:{spec[1]}"


def run_lightning(tmp_path, spec, steps, name, *extra):
    """Run tests/lightning_train.py (Lightning launches rank 1 itself) and load rank 0's result."""
    out = str(tmp_path / f"{name}.pt")
    # The script imports the test workers by name: tests/ (and the repository) on its path.
    path = os.pathsep.join(filter(None, [HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, os.path.join(HERE, "lightning_train.py"), _spec_text(spec), str(steps), out, *extra]
    proc = subprocess.run(command, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0])
def test_lightning_matches_hand_written_ddp(tmp_path, spec):
    pytest.importorskip("lightning", reason="needs lightning: pip install 'gradcomp[frameworks]'")
    steps = 8
    light = run_lightning(tmp_path, spec, steps, "lightning")
    hand = multiprocess.spawn(framework_workers.hand_written, 2, str(tmp_path), spec, steps)[0]
    assert light["step"] == hand["step"] == steps
    # The hook really compressed (dense would be ratio 1) and the ratio reached Lightning's logger.
    assert light["stats"]["total"]["compression_ratio"] > 1.5
    assert light["logged"]["gradcomp/compression_ratio"] > 1.5
    assert abs(light["held_out"] - hand["held_out"]) <= 0.01 * hand["held_out"]
    # Same data, same initialisation, same DDP buckets: the runs are the same computation.
    for name, value in hand["params"].items():
        assert torch.equal(light["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0])
def test_lightning_resume_is_bitwise(tmp_path, spec):
    pytest.importorskip("lightning", reason="needs lightning: pip install 'gradcomp[frameworks]'")
    ckpt = str(tmp_path / "half.ckpt")
    run_lightning(tmp_path, spec, 4, "first_half", "--save", ckpt)
    saved = torch.load(ckpt, weights_only=False)["gradcomp"]
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2
    resumed = run_lightning(tmp_path, spec, 8, "resumed", "--resume", ckpt)
    straight = run_lightning(tmp_path, spec, 8, "straight")
    assert resumed["step"] == straight["step"] == 8
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


RECIPE_SPECS = ["topk:0.1", "twobit:chunk"]


@pytest.mark.slow
@pytest.mark.parametrize("spec", RECIPE_SPECS)
def test_lightning_recipe_with_clipping_and_accumulation_matches_hand_written_ddp(tmp_path, spec):
    """GradcompCallback(recipe=True): AdamW and its per-step warm-up from configure_optimizers,
    gradient_clip_val, accumulate_grad_batches; the hand-written recipe loop on the same data."""
    pytest.importorskip("lightning", reason="needs lightning: pip install 'gradcomp[frameworks]'")
    steps = 8
    light = run_lightning(tmp_path, spec, steps, "lightning", "--recipe")
    hand = multiprocess.spawn(framework_workers.recipe_hand_written, 2, str(tmp_path), spec, steps,
                              framework_workers.ACCUMULATE)[0]  # fmt: skip
    assert light["step"] == hand["step"] == steps
    # The recipe read Lightning's scheduler (the warm-up's end) and run length (estimated_stepping_batches).
    assert light["dense_steps"] == hand["dense_steps"] == framework_workers.RECIPE_WARMUP - 1
    assert light["stats"]["total"]["bytes_sent"] == hand["stats"]["bytes_sent"]
    assert light["stats"]["total"]["compression_ratio"] > 1.3
    assert abs(light["held_out"] - hand["held_out"]) <= 0.01 * hand["held_out"]
    for name, value in hand["params"].items():
        assert torch.equal(light["params"][name], value), name


@pytest.mark.slow
def test_lightning_recipe_resume_is_bitwise(tmp_path):
    pytest.importorskip("lightning", reason="needs lightning: pip install 'gradcomp[frameworks]'")
    ckpt = str(tmp_path / "half.ckpt")
    # The first run is planned for 8 steps too (the recipe's plan depends on the run's length).
    run_lightning(tmp_path, "topk:0.1", 8, "first_half", "--recipe", "--save-at", "4", ckpt)
    assert len(torch.load(ckpt, weights_only=False)["gradcomp"]["ranks"]) == 2
    resumed = run_lightning(tmp_path, "topk:0.1", 8, "resumed", "--recipe", "--resume", ckpt)
    straight = run_lightning(tmp_path, "topk:0.1", 8, "straight", "--recipe")
    assert resumed["step"] == straight["step"] == 8
    for name, value in straight["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s[0])
def test_accumulation_no_sync_leaves_residuals_and_counts_optimizer_steps(tmp_path, spec):
    optimizer_steps, micro_steps = 3, 3
    results = multiprocess.spawn(framework_workers.accumulation, 2, str(tmp_path), spec, optimizer_steps, micro_steps)
    for result in results:
        records = result["records"]
        assert result["step"] == optimizer_steps
        assert result["stats_steps"] == optimizer_steps
        for index, record in enumerate(records):
            done = index // micro_steps + (1 if record["synced"] else 0)
            assert record["engine_step"] == done, (index, record)
            if not record["synced"]:
                assert record["residuals_unchanged"], (index, record)
        # After warm-up, a synchronised compressed step must change the residuals (the check can fail).
        assert not records[2 * micro_steps - 1]["residuals_unchanged"]


def readme_example(name):
    """The ```python block between ``<!-- example: NAME -->`` and ``<!-- /example: NAME -->`` in README.md."""
    with open(os.path.join(HERE, "..", "README.md")) as handle:
        text = handle.read()
    block = text.split(f"<!-- example: {name} -->", 1)[1].split(f"<!-- /example: {name} -->", 1)[0]
    return block.split("```python", 1)[1].split("```", 1)[0]


def test_lightning_readme_example_builds_a_trainer_with_the_callback():
    pytest.importorskip("lightning", reason="needs lightning: pip install 'gradcomp[frameworks]'")
    from gradcomp.hooks.lightning import GradcompCallback

    namespace = {}
    exec(compile(readme_example("lightning"), "README.md:lightning", "exec"), namespace)
    trainer = namespace["trainer"]
    assert any(isinstance(c, GradcompCallback) for c in trainer.callbacks)
    assert trainer.num_devices == 2
