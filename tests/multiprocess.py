"""The one harness for tests that start processes: N ranks over Gloo, or a ``horovodrun`` job.

* :func:`free_port` -- a TCP port nobody listens on, for a rendezvous on 127.0.0.1.
* :func:`spawn` -- run a top-level ``worker(rank, world_size, ...)`` on N ranks of a real Gloo
  process group (``torch.multiprocessing``, ``spawn`` start method), each with a timeout;
  collect what every rank returned; on failure, say which ranks failed and show their
  tracebacks.
* :func:`horovodrun` -- run a worker script under ``horovodrun -np N --gloo`` on this machine,
  with a timeout that ends horovodrun and every rank it started.

No mocks: every rank is an OS process and every collective crosses a real socket.
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks it; another process could still take it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(worker: Callable, world_size: int, out_dir, *args, timeout_s: float = 180, pg_timeout_s: float = 60,
          check: bool = True, pass_out_dir: bool = False):  # fmt: skip
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` Gloo ranks.

    Args:
        worker: a top-level function (the ``spawn`` start method pickles it by name). With
            ``pass_out_dir`` it is called as ``worker(rank, world_size, out_dir, *args)`` and
            may write its own files there.
        out_dir: a directory for the ranks' results: a rank's non-``None`` return value is saved
            to ``rank{r}.pt`` (``torch.save``), its uncaught exception to ``rank{r}.err``.
        timeout_s: the whole job's wall-clock limit; ranks still alive then are killed
            (their exit code is then negative).
        pg_timeout_s: the process group's timeout, so that a rank waiting on a dead peer fails
            instead of hanging until ``timeout_s``.
        check: raise ``AssertionError`` unless every rank exited with 0, with each failing
            rank's exit code and traceback in the message.
    Returns:
        ``results`` (``results[r]``: what rank ``r`` saved, or ``None``) when ``check``;
        ``(results, exit_codes)`` otherwise.
    """
    out_dir = str(out_dir)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(worker, rank, world_size, port, out_dir, args, pg_timeout_s,
                                               pass_out_dir))
             for rank in range(world_size)]  # fmt: skip
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    codes = [proc.exitcode for proc in procs]
    if check:
        assert codes == [0] * world_size, failure_report(worker, codes, out_dir, timeout_s)
    results = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
    return results if check else (results, codes)


def failure_report(worker: Callable, codes: Sequence[Optional[int]], out_dir: str, timeout_s: float) -> str:
    """Which ranks failed and why: exit codes, a timeout, and each rank's saved traceback."""
    lines = [f"{getattr(worker, '__name__', worker)}: ranks exited with {list(codes)}"]
    for rank, code in enumerate(codes):
        if code == 0:
            continue
        if code is not None and code < 0:
            lines.append(f"rank {rank}: killed by signal {-code} (still running after {timeout_s} s, or crashed)")
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as file:
                lines.append(f"rank {rank} raised:\n{file.read()[-3000:]}")
    return "\n".join(lines)


def _entry(worker, rank, world_size, port, out_dir, args, pg_timeout_s, pass_out_dir):
    torch.set_num_threads(1)  # ranks and tests share the cores; one thread each keeps them deterministic
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s))
    try:
        result = worker(rank, world_size, out_dir, *args) if pass_out_dir else worker(rank, world_size, *args)
        if result is not None:
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as file:
            file.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def horovodrun(script: Path, args: List[str], world_size: int = 2, timeout_s: float = 300) -> str:
    """Run ``python script *args`` under ``horovodrun -np world_size --gloo`` on localhost.

    ``tests/`` and the repository root are on ``PYTHONPATH``; one thread per rank. Returns the
    combined output; raises ``AssertionError`` with its tail if the job fails or runs past
    ``timeout_s`` (then horovodrun and every rank it started are killed).
    """
    return horovodrun_argv([sys.executable, str(script), *args], world_size, timeout_s)


def horovodrun_argv(argv: List[str], world_size: int = 2, timeout_s: float = 300) -> str:
    """:func:`horovodrun` of any command line ``argv`` (each rank runs it, from the repository root)."""
    beside_python = Path(sys.executable).parent / "horovodrun"
    launcher = str(beside_python) if beside_python.exists() else "horovodrun"
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), str(REPO), env.get("PYTHONPATH")]))
    command = [launcher, "-np", str(world_size), "--gloo", "-H", f"localhost:{world_size}", *argv]
    # A session of its own, so that a timeout can end horovodrun and every rank it started.
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"horovodrun did not finish in {timeout_s} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"horovodrun exited with {proc.returncode}:\n{output[-4000:]}"
    return output


def slow_except(cases, quick, one_name: bool = False) -> list:
    """``cases`` for ``pytest.mark.parametrize``, with every case not in ``quick`` marked ``slow``.

    Multi-process cases cost seconds each; the quick selection (``-m "not slow"``) keeps the
    ``quick`` ones, chosen so that each code path still runs once. ``one_name``: the
    parametrization has one argument name, so a tuple case is one value, not several.
    """
    quick = list(quick)
    missing = [case for case in quick if case not in cases]
    assert not missing, f"quick cases {missing} are not among the cases"
    slow = pytest.mark.slow
    return [case if case in quick else
            pytest.param(*(case if isinstance(case, tuple) and not one_name else (case,)), marks=slow)
            for case in cases]  # fmt: skip
