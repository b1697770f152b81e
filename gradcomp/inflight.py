"""Keep what a communication thread may release in Python's hands until that thread is done with it.

Why this exists. Gloo runs each collective on one of its own threads (``pt_gloo_runloop``). That
thread completes the collective's future -- which runs the ``.then`` callbacks and releases the rank
waiting in ``backward()`` -- and only *then* destroys the finished work object, which owns the
tensors it was handed; the callbacks (Python functions) are destroyed on the same thread. When it
holds the last reference to a tensor that has a Python object, or to a Python callback, the
destruction takes the GIL there. If the main thread has meanwhile finished the script and CPython
has begun finalizing, a thread that takes the GIL is ended with ``pthread_exit``; its forced unwind
meets a ``noexcept`` destructor and ``std::terminate`` aborts a rank whose work is all done
("terminate called without an active exception", exit code 134). Measured stack of the aborting
thread: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` -> ``TensorImpl::decref_pyobject``
-> ``PyEval_RestoreThread`` -> ``pthread_exit`` -> ``_Unwind_ForcedUnwind`` -> ``std::terminate``.
Slow kernels and busy threads on a loaded machine (Numba's parallel decode on the callback thread)
only widen the window; any Python-created tensor handed to an asynchronous collective has it.

The remedy: every tensor handed to a collective is also held here (with the count of references
it had before), and every callback is watched through a weak reference. Entries are dropped on the
calling Python thread once the communication thread has let go. At interpreter exit (``atexit``
runs before finalization starts) the main thread waits, bounded by :data:`EXIT_WAIT_S`, until the
communication threads have let go of everything, so they never need the GIL after finalization.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable, List, Set, Tuple

import torch

# The longest the interpreter's exit waits for collectives that never finish (a hung or dead
# peer); a finished job waits for one work object's destruction, i.e. microseconds.
EXIT_WAIT_S = 5.0
# Held tensors beyond this many are dropped oldest first: a communication thread lets go of a
# tensor right after the collective, so only the newest few can still be in use.
_MAX_HELD = 1024

_lock = threading.Lock()
_held: List[Tuple[torch.Tensor, int]] = []  # (tensor, its use count before it was handed over)
_callbacks: Set[weakref.ref] = set()  # callbacks not yet destroyed by the thread that ran them
_exit_hook_installed = False


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(wait_until_released)


def _prune() -> None:
    """Drop held tensors nobody but their usual owners refers to (caller holds :data:`_lock`)."""
    _held[:] = [(t, base) for t, base in _held[-_MAX_HELD:] if t._use_count() > base]


def hold(*tensors: torch.Tensor) -> None:
    """Hold ``tensors`` until the collective they are about to be handed to lets go of them.

    Call it *before* starting the collective: the use count taken now is what "let go" means
    (a bucket buffer is also held by DDP's reducer, a fresh buffer by no one else).
    """
    with _lock:
        _install_exit_hook()
        _prune()
        _held.extend((t, t._use_count()) for t in tensors)


def watch(callback: Callable) -> Callable:
    """Watch ``callback`` (to be passed to ``Future.then``) until the thread that runs it has
    destroyed it; returns ``callback``. The caller must not keep other references to it."""
    _install_exit_hook()
    _callbacks.add(weakref.ref(callback, _callbacks.discard))  # set ops are atomic under the GIL
    return callback


def pending() -> int:
    """How many held tensors and callbacks a communication thread may still release."""
    with _lock:
        _prune()
        return len(_held) + len(_callbacks)


def wait_until_released(timeout_s: float = EXIT_WAIT_S) -> bool:
    """Wait (sleeping, so the GIL is free for the communication threads) until every held tensor
    and watched callback has been let go of, then drop the tensors here. Returns whether that
    happened within ``timeout_s``. Registered with :mod:`atexit` on first use."""
    deadline = time.monotonic() + timeout_s
    while pending():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True
