"""Decisions a user must see reach a script that configures no logging, on one rank, once, and stay
quiet where the user silenced them (``warnings.simplefilter("ignore", gradcomp.RecipeNotice)``)."""
import os
import subprocess
import sys

import pytest

from multiprocess import free_port

WORKER = os.path.join(os.path.dirname(__file__), "notice_worker.py")


def run_ranks(*extra):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(port), *extra], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], errors
    return errors


@pytest.mark.multiprocess
def test_the_recipes_decisions_reach_stderr_on_rank_0_only():
    rank0, rank1 = run_ranks()
    assert rank0.count("RecipeNotice: gradcomp: recipe: ThreeBit(") == 1  # the summary
    assert rank0.count("under AdamW 2-bit runs as ThreeBit()") == 1  # the substituted code
    assert rank0.count("past the total_steps=3") == 1  # a run longer than its plan, said once
    assert "notice_worker.py" in rank0.split("RecipeNotice")[0].splitlines()[-1]  # attributed to the user's line
    assert "RecipeNotice" not in rank1


@pytest.mark.multiprocess
@pytest.mark.slow  # a second 2-rank job; the quick run keeps the one above
def test_a_user_silences_them_like_any_warning():
    rank0, rank1 = run_ranks("silence")
    assert "RecipeNotice" not in rank0 + rank1


def test_an_entry_point_shows_its_notices_at_its_callers_line_also_when_nested_or_raising():
    import warnings

    from gradcomp.setup import RecipeNotice, notice, speaks_to_caller

    @speaks_to_caller
    def inner():
        notice("inner")

    @speaks_to_caller
    def outer(fail):
        inner()
        notice("outer")
        if fail:
            raise ValueError("refused")

    for fail in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outer(fail)  # the line every notice names
            except ValueError:
                assert fail
        notices = [w for w in caught if issubclass(w.category, RecipeNotice)]
        assert [str(w.message) for w in notices] == ["gradcomp: inner", "gradcomp: outer"]
        assert all(w.filename == __file__ for w in notices), [w.filename for w in notices]
