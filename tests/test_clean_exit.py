"""A finished DDP job with gradcomp on the Numba backend exits with code 0, every time.

Gloo's thread completes a collective's future (releasing the rank waiting in backward()) and
only then destroys the work, which owned the tensors and callbacks Python gave it; when that
took the GIL after the interpreter had begun finalizing, the rank aborted after a successful
run ("terminate called without an active exception", exit 134). gradcomp.inflight gives every
tensor handed to a collective one more C++ owner, so Gloo's thread never takes the GIL for it,
and lets the interpreter's exit wait for Gloo's thread to destroy the callbacks.
"""
import os
import subprocess
import sys

import pytest
import torch

import ddp_workers as workers
import multiprocess
from gradcomp import inflight
from multiprocess import free_port

WORKER = os.path.join(os.path.dirname(__file__), "clean_exit_worker.py")
LATE_WORKER = os.path.join(os.path.dirname(__file__), "late_gloo_worker.py")
RUNS = 30


def _job(compressor: str, world_size: int = 2, timeout_s: float = 120.0):
    """Run one job to its end; the exit codes and stderr of its ranks."""
    # The product's default thread count (one per core), not the suite's single thread: the
    # parallel kernels must really run on a pool started from Gloo's callback thread.
    env = {**os.environ, "NUMBA_NUM_THREADS": str(max(2, os.cpu_count() or 2)), "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(rank), str(world_size), str(port), compressor],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in range(world_size)
    ]
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        results.append((proc.returncode, err))
    return results


@pytest.mark.multiprocess
@pytest.mark.slow  # 30 jobs; every other multi-process test also ends its ranks through the same exit path
def test_ddp_job_on_numba_exits_cleanly_30_times_in_a_row():
    for run in range(RUNS):
        compressor = "topk" if run % 2 == 0 else "twobit"
        results = _job(compressor)
        codes = [code for code, _ in results]
        assert codes == [0, 0], (
            f"run {run + 1}/{RUNS} ({compressor}): ranks exited with {codes}; stderr tails: "
            + " | ".join(err[-600:] for _, err in results)
        )


def test_a_held_alias_has_one_more_cxx_owner_until_the_collective_lets_go():
    # The collective's reference is stood in for by a C++ list; what matters is that its release
    # is never the step from 2 owners to 1, the one that takes the GIL for the Python object.
    base = torch.zeros(8)
    for tensor in (base, base[2:6]):  # a view is owned through its own TensorImpl, not its base's
        alone = tensor._use_count()
        (alias,) = inflight.hold(tensor)
        assert alias.data_ptr() == tensor.data_ptr() and alias is not tensor
        assert tensor._use_count() == alone  # the caller's tensor is not what is counted
        own = alias._use_count()
        collective = torch._C.ScriptList([alias])
        assert inflight.pending() >= 1 and alias._use_count() == own + 1
        del collective  # the collective lets go: 3 -> 2 on its thread, no GIL needed
        assert inflight.wait_until_released(timeout_s=1.0)
        assert alias._use_count() == own - 1  # the owner was dropped here, on the Python thread


def test_the_owner_made_here_is_one_more_cxx_reference_to_the_tensor_itself():
    # A view's _base is its root, so a view of a view would own the root, not the tensor.
    root = torch.zeros(8)
    for tensor in (root, root[2:6], root[::2]):
        before = tensor._use_count()
        owner = inflight._owner_of(tensor)
        assert tensor._use_count() == before + 1
        del owner
        assert tensor._use_count() == before


def test_a_tensor_whose_other_owner_lets_go_first_stays_held_until_the_collective_does():
    # DDP's reducer owns its bucket buffers; when the model is freed while Gloo still holds a
    # bucket, counting the bucket's own owners would take the reducer's release for the
    # collective's and let go too early (the abort of issue 31's last path).
    bucket = torch.zeros(8)
    reducer = torch._C.ScriptList([bucket])
    (alias,) = inflight.hold(bucket)
    collective = torch._C.ScriptList([alias])
    del reducer
    assert inflight.pending() >= 1 and not inflight.wait_until_released(timeout_s=0.05)
    del collective
    assert inflight.wait_until_released(timeout_s=1.0)


@pytest.mark.multiprocess
@pytest.mark.slow  # 2 ranks; the quick run keeps the in-process check above
def test_every_tensor_the_ddp_transport_hands_to_gloo_is_held_first(tmp_path):
    for report in multiprocess.spawn(workers.transport_holds, 2, tmp_path):
        assert report.pop("released")
        for collective, (held, handed) in report.items():
            assert handed <= held, f"{collective}: handed to Gloo but not held: {handed - held}"


def run_late_gloo_job(mode: str) -> subprocess.CompletedProcess:
    """Both ranks of ``late_gloo_worker.py``; rank 0's outcome."""
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peer = subprocess.Popen([sys.executable, LATE_WORKER, port, "1", mode], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return subprocess.run([sys.executable, LATE_WORKER, port, "0", mode], capture_output=True, text=True,
                              timeout=120, env=env)
    finally:
        peer.wait(timeout=120)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_late_gloo_thread_aborts_a_finished_script_unless_its_tensors_are_held():
    # The measured abort, forced (late_gloo_worker.py): Gloo's thread frees a Python tensor while
    # the script ends. Measured under load 7: 6 of 6 bare jobs aborted, 6 of 6 held jobs exited 0.
    # "shared": the tensors have other C++ owners (DDP's reducer) that let go while Gloo holds them.
    bare = []
    for _ in range(2):  # a second try only where the first did not abort
        bare.append(run_late_gloo_job("bare"))
        if bare[-1].returncode in (-6, 134):
            break
    assert any(p.returncode in (-6, 134) and "terminate called" in p.stderr for p in bare), (
        f"the forced teardown order no longer aborts a bare script: {[(p.returncode, p.stderr[-300:]) for p in bare]}")
    # "foreign": the same bare tensors in a process that uses gradcomp, whose exit waits for Gloo's threads.
    for mode in ("held", "shared", "foreign", "held", "shared", "foreign"):
        held = run_late_gloo_job(mode)
        assert held.returncode == 0, f"{mode}: the exit was not clean: {held.returncode} {held.stderr[-400:]}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tensors_a_callback_reads_from_a_gather_are_freed_by_the_main_thread_once_kept():
    # The DDP hook's callback reads its allgather's future; value() makes Python objects of the
    # work's views of the output, which Gloo's thread then frees after the callback (the measured
    # abort of a 2-bit job, 1 rank in 2-30 jobs). Kept (inflight.keep), the main thread frees them.
    bare = run_late_gloo_job("value")
    assert bare.returncode in (0, -6, 134) and (bare.returncode != 0 or "freed by Gloo's thread" in bare.stdout), (
        f"bare: {bare.returncode} {bare.stdout!r} {bare.stderr[-300:]}")
    for _ in range(2):
        kept = run_late_gloo_job("kept")
        assert kept.returncode == 0 and "freed by the main thread" in kept.stdout, (
            f"kept: {kept.returncode} {kept.stdout!r} {kept.stderr[-400:]}")


def test_a_kept_tensor_stays_held_until_its_other_cxx_owner_lets_go():
    # A tensor the work owns, made a Python object by a future's value(): the work is its other owner.
    work = torch._C.ScriptList([torch.arange(8.0)])
    value = [[work[0]]]
    inflight.keep(value)
    del value
    assert inflight.pending() >= 1 and not inflight.wait_until_released(timeout_s=0.05)
    del work  # the work lets go: 3 -> 2, no GIL needed on its thread
    assert inflight.wait_until_released(timeout_s=1.0)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_tensor_of_a_one_file_checkpoint_gather_is_held_first(tmp_path):
    # full_state_dict() is often a script's last collective (the final torch.save follows it).
    for report in multiprocess.spawn(workers.gathers_hold, 2, tmp_path):
        assert report["ranks"] == 2 and report["released"]
        assert report["handed"] and report["handed"] <= report["held"], report["handed"] - report["held"]
