"""Start a test script on 2 CPU ranks the way users start theirs: ``accelerate launch`` or ``torchrun``.

Each job gets a free port on 127.0.0.1, Gloo on the loopback, one thread per rank, ``tests/`` and the
repository on ``PYTHONPATH``, a session of its own (a timeout ends the launcher and every rank it
started) and a wall-clock limit; a failing job raises ``AssertionError`` with the tail of its output.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import multiprocess

TESTS = Path(__file__).resolve().parent


def environment() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               # No accelerator here: Accelerate then runs its ranks on CPUs over Gloo (as --cpu would).
               ACCELERATE_USE_CPU="true")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), env.get("PYTHONPATH")]))
    return env


def run(command: List[str], cwd, timeout_s: float = 400) -> str:
    """Run ``command`` in ``cwd``; its combined output, or ``AssertionError`` on failure or timeout."""
    proc = subprocess.Popen(command, cwd=str(cwd), env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{command[:4]} did not finish in {timeout_s} s:\n{output[-4000:]}") from None
    assert proc.returncode == 0, f"{command[:4]} exited with {proc.returncode}:\n{output[-6000:]}"
    return output


def script_with(path: Path, *parts: str) -> Path:
    """Write ``parts`` (code) one after another into ``path``: a README block between its preamble and
    its checks, run as a script under a launcher."""
    path.write_text("\n".join(part.strip("\n") + "\n" for part in parts))
    return path


def accelerate_launch(script: str, args: List[str], cwd, world_size: int = 2, timeout_s: float = 400) -> str:
    """``accelerate launch`` of ``tests/<script>`` (or of the absolute path ``script``) on ``world_size``
    processes (with no accelerator here, the ranks use Gloo: see :func:`environment`)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(world_size),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_ip", "127.0.0.1", "--main_process_port", str(multiprocess.free_port()),
               str(TESTS / script), *args]  # fmt: skip
    return run(command, cwd, timeout_s)


def torchrun(script: str, args: List[str], cwd, world_size: int = 2, timeout_s: float = 400) -> str:
    """``torchrun --nproc_per_node world_size`` of ``tests/<script>`` (how the HF Trainer is launched)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_addr", "127.0.0.1", "--master_port", str(multiprocess.free_port()),
               str(TESTS / script), *args]  # fmt: skip
    return run(command, cwd, timeout_s)
