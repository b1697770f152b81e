"""How the experiments start their ranks: local processes on the loopback, one thread each.

The one launcher of the experiments; every script that starts ranks builds on it.

* :func:`parse_args`: the command line of one run (``experiments.train``, ``experiments.fsdp_train``).
* :func:`spawn_ranks`: ``nproc`` local ranks of a rank function, bounded in time; a rank that
  fails stops the others. :func:`spawn` runs the ranks of one run's command line with it.
* :func:`run_commands`: one command line per rank (ranks that must be fresh interpreters, or start
  inside their own network namespace), bounded in time, each rank's exit status.
* :func:`init_rank`: in a rank, its threads, its device and the process group; :func:`rank_device`
  the threads and the device alone.
* :func:`run_bounded`: a command in its own process group, stopped (the whole group) at its timeout.
* :func:`free_port`: a rendezvous port on the loopback.
* :func:`set_thread_env`: the thread counts of torch, OpenMP and Numba, before they are imported.
* :func:`lo_tx_bytes`: bytes sent on a private namespace's loopback (``experiments.netem``).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from experiments.catalog import METHODS
from experiments.methods import AUTO_THRESHOLD_SCALE

__all__ = ["parse_args", "spawn", "spawn_ranks", "run_commands", "init_rank", "rank_device", "run_bounded", "free_port",
           "set_thread_env", "lo_tx_bytes", "NETNS_ENV"]

NETNS_ENV = "GRADCOMP_NETNS"  # set by experiments.netem: the name of the private namespace we run in


def _parser() -> argparse.ArgumentParser:
    """The run's command line: workload, method, loop, ranks, limits."""
    methods = "\n".join(f"  {m.name:12s} {m.description}" for m in METHODS.values())
    parser = argparse.ArgumentParser(
        prog="python -m experiments.train",
        description="DDP training runner: one workload, one gradient-communication method, N ranks.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=f"methods (--compressor):\n{methods}",
    )  # fmt: skip
    parser.add_argument("--workload", choices=("charlm", "digits"), default="charlm")
    parser.add_argument("--small", action="store_true", help="charlm: the small preset (d_model 128, 2 layers)")
    parser.add_argument("--d-model", type=int, help="charlm: override the preset's width")
    parser.add_argument("--layers", type=int, help="charlm: override the preset's depth")
    parser.add_argument("--heads", type=int, help="charlm: override the preset's heads")
    parser.add_argument("--context", type=int, help="charlm: override the preset's context length")
    parser.add_argument("--compressor", choices=tuple(METHODS), default="dense", help="the method (see below)")
    parser.add_argument(
        "--density", type=float, default=0.01, help="top-k: the fraction of entries sent (default 0.01)"
    )
    parser.add_argument(
        "--threshold",
        default="rms",
        help="2-bit threshold: 'rms' (default: per parameter and step, see gradcomp.TwoBit), a positive number, "
        "or 'auto': --threshold-scale x the RMS of the averaged gradient at the last dense warm-up step",
    )
    parser.add_argument(
        "--threshold-scale", type=float, default=AUTO_THRESHOLD_SCALE,
        help="2-bit with --threshold auto: the threshold in units of the gradient RMS "
        f"(default {AUTO_THRESHOLD_SCALE})",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=100, help="training steps (every run is bounded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizer", choices=("adamw", "sgd"), default="adamw", help="AdamW, or SGD with momentum 0.9"
    )
    parser.add_argument("--lr", type=float, help="peak learning rate (default: AdamW 1e-3, SGD 0.1)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch (default: charlm 16, digits 32)")
    parser.add_argument("--lr-warmup", type=int, help="linear LR warm-up steps (default: min(20, steps // 10))")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    parser.add_argument("--eval-windows", type=int, default=64, help="charlm: held-out windows per evaluation")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch and numba threads per rank")
    parser.add_argument("--log", help="JSON-lines log written by rank 0")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--max-time", type=float, default=3600.0, help="wall-clock limit of the whole run, seconds")
    parser.add_argument("--backend", help="gradcomp kernel backend override (one of gradcomp.backends.BACKENDS)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The run's arguments (:func:`_parser`), checked: a bad value exits with argparse's message."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.nproc < 1 or args.threads < 1:
        parser.error("--nproc and --threads must be >= 1")
    if not args.threshold_scale > 0 or not math.isfinite(args.threshold_scale):
        parser.error("--threshold-scale must be a positive number")
    if args.threshold not in ("auto", "rms"):
        try:
            value = float(args.threshold)
        except ValueError:
            value = math.nan
        if not value > 0 or not math.isfinite(value):
            parser.error(f"--threshold must be a positive number, 'rms' or 'auto', got {args.threshold!r}")
    if args.backend is not None:
        # Only when asked: gradcomp imports torch, which the launching process otherwise avoids.
        from gradcomp.backends import BACKENDS

        if args.backend not in BACKENDS:
            parser.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    return args


def set_thread_env(threads: int) -> None:
    """Set the thread counts of OpenMP, MKL and Numba for this process and its children."""
    # Must happen before numba (gradcomp's CPU backend) or OpenMP are first imported.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = str(threads)


def lo_tx_bytes() -> Optional[int]:
    """Bytes sent on the loopback, when it is our private namespace's (else ``None``:
    the host loopback also carries other people's traffic)."""
    if not os.environ.get(NETNS_ENV):
        return None
    try:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def free_port() -> int:
    """A free TCP port on the loopback for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(args: argparse.Namespace, target: Callable, *lead) -> int:
    """Run ``args.nproc`` local ranks of ``target(rank, world_size, *lead, args)`` (the runner's
    :func:`experiments.runner.run_rank` with a run class), bounded by ``args.max_time``; the exit status
    (:func:`spawn_ranks`)."""
    return spawn_ranks(target, args.nproc, (*lead, args), args.max_time)


def spawn_ranks(target: Callable, nproc: int, args: tuple = (), max_time: float = 3600.0, name: str = "train") -> int:
    """Run ``target(rank, nproc, *args)`` in ``nproc`` local processes, bounded by ``max_time``
    seconds; the exit status: 0, 1 (a rank failed) or 124 (out of time).

    Plain ``multiprocessing`` with the spawn method: the parent never imports torch,
    which saves seconds per run on a small machine. A rank that fails prints its own
    traceback; the others are then stopped rather than left waiting in a collective.
    ``name`` starts the launcher's own messages.
    """
    import multiprocessing

    # Local ranks talk over the loopback only (inside netem's namespace it is the shaped
    # one; without GLOO_SOCKET_IFNAME Gloo would pick the interface of the hostname).
    # A full-duplex link (GRADCOMP_NETNS_RANKS) gives each rank its own namespace: netem set the
    # address of rank 0 there and the interface.
    if not os.environ.get("GRADCOMP_NETNS_RANKS"):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_PORT"] = str(free_port())
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=target, args=(rank, nproc, *args), name=f"rank{rank}", daemon=False)
                 for rank in range(nproc)]
    for process in processes:
        process.start()
    return _watch(processes, time.monotonic() + max_time, max_time, name)


def _watch(processes, deadline: float, max_time: float, name: str) -> int:
    """Wait for the ranks; stop them all when one fails or at ``deadline``. The exit status."""
    try:
        while any(p.is_alive() for p in processes):
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                print(f"{name}: {failed[0].name} exited with status {failed[0].exitcode}; stopping the others",
                      file=sys.stderr, flush=True)
                _stop(processes)
                return 1
            if time.monotonic() > deadline:
                print(f"{name}: --max-time {max_time:.0f}s exceeded; stopping the ranks", file=sys.stderr, flush=True)
                _stop(processes)
                return 124
            processes[0].join(timeout=0.5)
    except KeyboardInterrupt:
        _stop(processes)
        raise
    failed = [p for p in processes if p.exitcode != 0]
    if failed:
        print(f"{name}: {failed[0].name} exited with status {failed[0].exitcode}", file=sys.stderr, flush=True)
        return 1
    return 0


def run_commands(commands: Sequence[Sequence[str]], timeout: float, env: Optional[Dict[str, str]] = None,
                 stderr_text: bool = False, **popen_kwargs) -> Tuple[List[int], List[str]]:
    """Run one command line per rank, all at once, each to its end (a rank that fails does not stop
    the others: its status is what is measured); at ``timeout`` seconds the ones left are killed.

    The ranks meet at ``MASTER_ADDR`` of ``env`` (default: this environment; the loopback where it
    names none) and a free ``MASTER_PORT``. Returns every rank's exit status and, with
    ``stderr_text``, what each wrote to stderr (read from a file: a pipe that fills would block it).
    """
    import tempfile

    env = dict(os.environ if env is None else env)
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    with contextlib.ExitStack() as files:
        errors = [files.enter_context(tempfile.TemporaryFile("w+")) if stderr_text else None for _ in commands]
        processes = [subprocess.Popen(list(command), env=env, stderr=error, text=True, **popen_kwargs)
                     for command, error in zip(commands, errors)]
        deadline = time.monotonic() + timeout
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        texts = []
        for error in errors:
            if error is not None:
                error.seek(0)
            texts.append(error.read() if error is not None else "")
    return [process.returncode for process in processes], texts


def init_rank(rank: int, world_size: int, threads: int, timeout: float, local_rank: Optional[int] = None,
              cuda: bool = True):
    """In a rank: torch's threads, the device and the process group (from ``MASTER_ADDR``/``MASTER_PORT``);
    ``(device, process group backend)``. NCCL on the GPU ``local_rank`` where ``cuda`` and there is
    one, else Gloo on the CPU. The thread counts of OpenMP and Numba are the environment's
    (:func:`set_thread_env` before their import)."""
    import datetime

    import torch.distributed as dist

    device = rank_device(rank, threads, local_rank, cuda)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
    return device, backend


def rank_device(rank: int, threads: int, local_rank: Optional[int] = None, cuda: bool = True):
    """In a rank: torch's thread counts (``threads``, one inter-op thread) and the rank's device, the
    current one from now on: the GPU ``local_rank`` (default ``rank``) where ``cuda`` and there is one,
    else the CPU. Used by :func:`init_rank` and by ranks whose collectives are not torch's (Horovod)."""
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    if not (cuda and torch.cuda.is_available()):
        return torch.device("cpu")
    device = torch.device("cuda", rank if local_rank is None else local_rank)
    torch.cuda.set_device(device)
    return device


def _stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def run_bounded(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None, **popen_kwargs) -> int:
    """Run ``argv`` in its own process group; on timeout stop that whole group (the
    command and the ranks it spawned) and return 124. Otherwise its exit status."""
    process = subprocess.Popen(list(argv), env=env, start_new_session=True, **popen_kwargs)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        return 124
    except BaseException:
        _stop_group(process)
        raise


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
