"""A finished DDP job with gradcomp on the Numba backend exits with code 0, every time.

Gloo's thread completes a collective's future (releasing the rank waiting in backward()) and
only then destroys the work, which owned the tensors and callbacks Python gave it; when that
took the GIL after the interpreter had begun finalizing, the rank aborted after a successful
run ("terminate called without an active exception", exit 134). gradcomp.inflight keeps those
objects in Python's hands and lets the interpreter's exit wait for Gloo's thread.
Measured before the fix (2-rank TopK jobs, 2 Numba threads, a loaded 2-core machine): 2 of 30
jobs aborted with the default switch interval, 4 of 14 with the worker's long one; after: 0.
"""
import os
import subprocess
import sys

from multiprocess import free_port

WORKER = os.path.join(os.path.dirname(__file__), "clean_exit_worker.py")
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


def test_ddp_job_on_numba_exits_cleanly_30_times_in_a_row():
    for run in range(RUNS):
        compressor = "topk" if run % 2 == 0 else "twobit"
        results = _job(compressor)
        codes = [code for code, _ in results]
        assert codes == [0, 0], (
            f"run {run + 1}/{RUNS} ({compressor}): ranks exited with {codes}; stderr tails: "
            + " | ".join(err[-600:] for _, err in results)
        )
