"""Every ```python block of the README runs, as written, on real ranks.

DDP blocks run on a 2-rank Gloo group, Horovod blocks under ``horovodrun -np 2 --gloo``
(skipped, with the reason, where Horovod is not installed). A new block is picked up by itself;
a block opts out only with ``# readme-test: skip -- <why>`` as its first line
(:mod:`readme_worker` gives the names a block may use without defining them).
"""
import importlib.util

import pytest

import multiprocess
import readme_worker
from readme_worker import python_blocks

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 2
BLOCKS = python_blocks()
HOROVOD = importlib.util.find_spec("horovod") is not None


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("readme_ddp")
    return multiprocess.spawn(readme_worker.run_ddp_blocks, WORLD_SIZE, out, timeout_s=300, pass_out_dir=True)


@pytest.fixture(scope="module")
def horovod_results(tmp_path_factory):
    import torch

    out = tmp_path_factory.mktemp("readme_horovod")
    multiprocess.horovodrun(multiprocess.REPO / "tests" / "readme_worker.py", [str(out)], WORLD_SIZE)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


#: Blocks that need their framework's launcher, and the test that runs each under it.
LAUNCHED_ELSEWHERE = {"accelerate": "tests/test_accelerate.py", "hf_trainer": "tests/test_hf_trainer.py"}


def test_the_readme_has_blocks_of_every_kind():
    kinds = {block.kind for block in BLOCKS}
    assert kinds == {"ddp", "horovod", *LAUNCHED_ELSEWHERE}, kinds


def test_framework_blocks_are_examples_their_tests_run():
    """An Accelerate or HF Trainer block runs in its own test under its launcher, found by its
    ``<!-- example: KIND -->`` marker: exactly one such block per kind."""
    text = readme_worker.README.read_text()
    for kind in LAUNCHED_ELSEWHERE:
        blocks = [b for b in BLOCKS if b.kind == kind]
        assert len(blocks) == 1 and text.count(f"<!-- example: {kind} -->") == 1, kind
        marked = text.split(f"<!-- example: {kind} -->", 1)[1].split(f"<!-- /example: {kind} -->", 1)[0]
        assert blocks[0].code.strip() in marked, kind


# Both jobs (one for the DDP blocks, one horovodrun for the Horovod blocks) are slow; the quick selection
# keeps the in-process checks of the blocks around this test.
CASES = [pytest.param(b, marks=[pytest.mark.horovod, pytest.mark.slow] if b.kind == "horovod" else pytest.mark.slow)
         for b in BLOCKS if b.kind not in LAUNCHED_ELSEWHERE]  # fmt: skip


@pytest.mark.parametrize("block", CASES, ids=lambda block: block.name)
def test_readme_block_runs_as_written(block, request):
    reason = block.opt_out_reason
    if reason is not None:
        assert reason, f"{block.name} opts out of this test without saying why (# readme-test: skip -- <why>)"
        pytest.skip(f"{block.name} opts out: {reason}")
    if block.kind == "horovod":
        if not HOROVOD:
            pytest.skip("Horovod is not installed (scripts/build_horovod.sh builds it)")
        ranks = request.getfixturevalue("horovod_results")
    else:
        ranks = request.getfixturevalue("ddp_results")
    for rank, results in enumerate(ranks):
        assert block.name in results, f"rank {rank} did not run {block.name}"
        assert results[block.name] is None, f"{block.name} failed on rank {rank}:\n{results[block.name]}"


def test_opt_out_needs_a_marker_with_a_reason(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("```python\n# readme-test: skip -- needs a GPU\nx = 1\n```\n\n```python\ny = hvd.rank()\n```\n"
                      "```python\n# readme-test: skip\n```\n")  # fmt: skip
    first, second, third = python_blocks(readme)
    assert (first.line, first.opt_out_reason, first.kind) == (2, "needs a GPU", "ddp")
    assert (second.line, second.opt_out_reason, second.kind) == (7, None, "horovod")
    assert third.opt_out_reason == ""  # marked without a reason: the test above fails for it


def test_the_readmes_generated_tables_are_the_results_files():
    from experiments import readme_tables

    assert readme_tables.main(["--check"]) == 0, "run python -m experiments.readme_tables"


def test_the_study_time_table_gives_each_cell_its_methods_per_link_and_says_never():
    from experiments import readme_tables

    def row(method, link, ratio, **extra):
        return {"workload": "w", "optimizer": "adamw", "method": method, "link": link, "time_ratio_vs_dense": ratio,
                "spread": 0.02, "load_before": 0.3, "ratio_spread": None if method == "dense" else 0.05, **extra}

    rows = [row("dense", "1gbit", 0.8, dense_step_over_compute=1.2), row("topk", "1gbit", None),
            row("twobit", "1gbit", 0.95), row("dense", "10mbit", 0.8, dense_step_over_compute=20.0),
            row("topk", "10mbit", None), row("twobit", "10mbit", 0.1)]
    table = readme_tables.study_time_table(rows)
    assert "| w | adamw | never / 0.10x (20.0) | never / 0.95x (1.2) |" in table  # slow links first
    assert "spread between rounds 2%–2%, paired ratios 5.0%–5.0%; load before the timing run: 0.3" in table



def test_the_study_accuracy_table_keeps_the_classifiers_rows_and_says_never():
    from experiments import readme_tables

    def row(workload, method, link, ratio):
        target = None if workload == "lm" else 0.985
        return {"workload": workload, "optimizer": "sgdm", "method": method, "link": link,
                "accuracy_target": target, "accuracy_time_ratio_vs_dense": ratio}

    rows = [row("cnn", "topk", "1gbit", 0.9), row("cnn", "twobit", "1gbit", None), row("cnn", "topk", "10mbit", 0.34),
            row("cnn", "twobit", "10mbit", 0.15), row("lm", "topk", "10mbit", None)]
    table = readme_tables.study_accuracy_table(rows)
    assert "| cnn | sgdm | 0.34x / 0.15x | 0.90x / never |" in table and "| lm |" not in table
