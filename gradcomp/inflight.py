"""Keep what a communication thread may release in Python's hands until that thread is done with it.

Why this exists. Gloo runs each collective on one of its own threads (``pt_gloo_runloop``). That
thread completes the collective's future -- which runs the ``.then`` callbacks and releases the rank
waiting in ``backward()`` -- and only *then* destroys the finished work object, which owns the
tensors it was handed; the callbacks (Python functions) are destroyed on the same thread. A tensor
that has a Python object needs the GIL whenever its C++ use count falls from 2 to 1
(``intrusive_ptr::reset_`` calls ``TensorImpl::decref_pyobject``, which hands the Python object back
to Python), and a callback needs it to be destroyed. If the main thread has meanwhile finished the
script and CPython has begun finalizing, a thread that takes the GIL is ended with ``pthread_exit``;
its forced unwind meets a ``noexcept`` destructor and ``std::terminate`` aborts a rank whose work is
all done ("terminate called without an active exception", exit code 134). Measured stack of the
aborting thread: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
``TensorImpl::decref_pyobject`` -> ``PyEval_RestoreThread`` -> ``pthread_exit`` ->
``_Unwind_ForcedUnwind`` -> ``std::terminate``. Any Python-created tensor handed to a collective,
blocking or not, has the window; slow kernels and busy threads on a loaded machine only widen it.

The remedy has two parts:

* A collective is never handed the caller's tensor but an alias of it (:func:`hold`: the same
  storage, a ``TensorImpl`` of its own) that only the collective and this module own, plus one more
  C++ owner here (a view of the alias, whose ``_base`` is a C++ reference to it). The communication thread's
  release is then never the 2 -> 1 step: it never takes the GIL for a tensor. The owner and the
  alias are dropped on a Python thread once the alias's use count is back to what this module
  alone gives it. Counting on the caller's tensor instead is wrong when it has other C++ owners
  (DDP's reducer owns its bucket buffers): when one of them lets go first, the count falls back
  while the collective still holds the tensor.
* A callback that reads a collective's future (``value()``) gets Python objects for the tensors
  the work holds, and the work is destroyed on Gloo's thread after the callback: :func:`keep` gives
  those tensors the same C++ owner here. Measured stack of that abort (a 2-bit DDP job that ended
  right after its last step): ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
  ``~AsyncWork`` -> ``~vector<vector<Tensor>>`` (the work's outputs, made Python objects by the
  hook's ``value()``) -> ``TensorImpl::decref_pyobject`` -> ``THPVariable_dealloc`` ->
  ``PyEval_RestoreThread`` -> ``pthread_exit``, while the main thread was in ``Py_FinalizeEx``.
  The work releases its inputs (held aliases) before its outputs, so waiting for the aliases alone
  let the exit begin inside that window.
* Collectives gradcomp does not start (the HF Trainer gathers its FLOP count on Python tensors at
  the end of training) cannot be held: after the exact wait below, the exit also waits, bounded,
  until Gloo's worker threads have been idle for a while (:func:`wait_for_idle_gloo_threads`).
* Every callback is watched through a weak reference, and at interpreter exit (``atexit`` runs
  before finalization starts) the main thread waits, bounded by :data:`EXIT_WAIT_S`, until the
  communication threads have destroyed every callback and let go of every tensor.

Holding the tensor's Python object alone is not enough: the use count then falls from 2 to 1 on
the communication thread, and counting references from Python cannot tell whether that thread has
already taken the GIL for it (measured: 1 aborted rank in 36 two-rank jobs, see
``tests/test_clean_exit.py``).

A *blocking* collective has the same window: ``work.wait()`` returns once the work is complete, but
Gloo's thread destroys the work -- and releases the tensors it owns -- only afterwards. A script
that ends right after its last collective (``full_state_dict()`` before the final ``torch.save`` is
the common one) can begin finalizing inside that window. Measured stack of such an abort, a rank of
a test that saved a checkpoint at its end: Gloo's thread in ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllgatherWork`` -> ``~vector<vector<Tensor>>`` -> ``TensorImpl::decref_pyobject`` ->
``THPVariable_dealloc`` -> ``PyEval_RestoreThread`` -> ``pthread_exit`` -> ``std::terminate``, while
the main thread was in ``Py_FinalizeEx`` -> ``gc`` -> ``~ProcessGroupGloo``, waiting for that thread.
:func:`all_gather_object` is the gather gradcomp's blocking collectives use: every tensor it hands
to Gloo is held, so the exit waits for Gloo's thread to let go of them.
"""
from __future__ import annotations

import atexit
import io
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Set, Tuple

import torch

# The longest the interpreter's exit waits for collectives that never finish (a hung or dead
# peer); a finished job waits for one work object's destruction, i.e. microseconds.
EXIT_WAIT_S = 5.0
# Then, at most this long, the exit waits for Gloo's worker threads to be idle: a collective gradcomp
# did not start (the Trainer's gather of its FLOP count, a logging all_reduce) hands Gloo Python
# tensors that it cannot hold, and the work that owns them is destroyed after wait() returns.
IDLE_WAIT_S = 2.0
# Gloo's worker threads are idle when none has been running or runnable for this long, sampled every
# millisecond while this thread sleeps with the GIL free: longer than CPython's switch interval
# (5 ms), the longest another Python thread keeps a thread that waits for the GIL off it.
IDLE_FOR_S = 0.02
_GLOO_THREAD = "pt_gloo_runloop"  # ProcessGroupGloo::runLoop's thread name
# Held tensors beyond this many are dropped oldest first: a communication thread lets go of a
# tensor right after the collective, so only the newest few can still be in use.
_MAX_HELD = 1024

# A tensor's C++ use count from this module alone: its Python object (held in ``_held``) and the
# owner made by :func:`_owner_of`.
_OWN_USE_COUNT = 2

_lock = threading.Lock()
# (tensor, its C++ owner here, its use count with that owner before it was handed over)
_held: List[Tuple[torch.Tensor, object, int]] = []
_callbacks: Set[weakref.ref] = set()  # callbacks not yet destroyed by the thread that ran them
_exit_hook_installed = False


def _install_exit_hook() -> None:
    global _exit_hook_installed
    if not _exit_hook_installed:
        _exit_hook_installed = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    """Before the interpreter finalizes: gradcomp's own tensors and callbacks let go of (exact), then
    Gloo's worker threads idle (for the collectives gradcomp did not start)."""
    wait_until_released()
    wait_for_idle_gloo_threads()


def _gloo_thread_running() -> bool:
    """Whether a Gloo worker thread of this process is running or runnable (``R`` in ``/proc``; a
    thread freeing a finished work's tensors, or about to). ``False`` where ``/proc`` is missing."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:  # the thread ended meanwhile
            continue
        head, _, fields = stat.rpartition(")")  # "pid (name) state ...": the name may hold spaces
        if head.partition("(")[2] == _GLOO_THREAD and fields.split(None, 1)[0] == "R":
            return True
    return False


def wait_for_idle_gloo_threads(timeout_s: float = IDLE_WAIT_S) -> bool:
    """Wait (sleeping, the GIL free) until no Gloo worker thread has run for :data:`IDLE_FOR_S`.
    Returns whether that happened within ``timeout_s``.

    Not exact, unlike :func:`wait_until_released`: a thread that blocks on a lock for longer than
    :data:`IDLE_FOR_S` before freeing a tensor is taken for idle. It covers what cannot be held:
    the Python tensors of other libraries' collectives (measured: an HF Trainer rank aborted after
    its last step, where the Trainer gathers its FLOP count on Python tensors)."""
    deadline = time.monotonic() + timeout_s
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < IDLE_FOR_S:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
        if _gloo_thread_running():
            idle_since = time.monotonic()
    return True


def _prune() -> None:
    """Drop the tensors (and their owners here) that no collective uses any more (caller holds
    :data:`_lock`); the last use count step to 1 then happens on this Python thread."""
    _held[:] = [entry for entry in _held[-_MAX_HELD:] if entry[0]._use_count() > entry[2]]


def _owner_of(tensor: torch.Tensor):
    """A C++ owner of ``tensor``: a view of it (its ``_base`` is a C++ reference to ``tensor``) where
    ``tensor`` is no view itself, else a one-element ``torch.ScriptList`` (a ``c10::List`` of tensors):
    a view of a view holds only the root base, and a sparse tensor has no views. A Python container holds only
    the Python object.
    The view is the cheaper (thread CPU inside DDP's hook, 2 ranks beside other jobs: about 30 us against
    100 us for the list, which infers a type at every call), and an alias made by ``detach()`` is never a view."""
    if not tensor._is_view() and tensor.layout == torch.strided:  # a sparse tensor has no views
        return tensor.view(tensor.shape)
    return torch._C.ScriptList([tensor])


def hold(*tensors: torch.Tensor) -> List[torch.Tensor]:
    """What to hand to a collective in place of ``tensors``: one alias per tensor (``detach()``: the
    same storage, no autograd, a ``TensorImpl`` of its own), owned here until the collective lets go.

    Call it *before* starting the collective and hand the collective the aliases; what it writes
    into them is in ``tensors``. Nothing else owns an alias, so "let go" is exact even when the
    caller's tensor has other C++ owners that may drop it meanwhile (see the module docstring).
    """
    aliases = [tensor.detach() for tensor in tensors]
    with _lock:
        _install_exit_hook()
        _prune()
        for alias in aliases:
            owner = _owner_of(alias)
            _held.append((alias, owner, alias._use_count()))
    return aliases


def keep(value: Any) -> None:
    """Own the tensors of ``value`` here until the collective lets go of them: ``value`` is what a
    collective future's ``value()`` gave a callback (a tensor, or lists and tuples of them).

    ``value()`` makes a Python object for every tensor the work holds that had none (Gloo's
    allgather gives back views of its output that only the work owns). When the work is destroyed
    on Gloo's thread its release of such a tensor is the 2 -> 1 step that takes the GIL, and at
    interpreter exit that aborts the rank (see the module docstring). One more C++ owner here keeps
    that step on a Python thread. Call it in the callback, while the work still holds the tensors.
    """
    tensors, pending = [], [value]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    with _lock:
        _install_exit_hook()
        for tensor in tensors:
            # What this module alone gives the tensor: its Python object's reference and the owner.
            _held.append((tensor, _owner_of(tensor), _OWN_USE_COUNT))


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


def all_gather_object(obj: Any, group: Optional[object] = None) -> List[Any]:
    """Every rank's ``obj`` in rank order, as ``torch.distributed.all_gather_object`` gives it, with
    every tensor handed to the collectives held until Gloo's thread lets go (see the module
    docstring). Blocking; every rank of ``group`` (default: the default group) must call it.

    ``obj`` travels as ``torch.save`` bytes and is read back with ``torch.load(weights_only=True)``:
    tensors, numbers, strings, ``None`` and dicts, lists and tuples of them. What a peer sends is
    data, never code to run (``all_gather_object`` unpickles whatever arrives).
    """
    import torch.distributed as dist

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    world_size = dist.get_world_size(group)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    size_sent, *sizes_received = hold(size, *sizes)
    dist.all_gather(sizes_received, size_sent, group=group)
    lengths = [int(s) for s in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    padded_sent, *parts_received = hold(padded, *parts)
    dist.all_gather(parts_received, padded_sent, group=group)
    return [torch.load(io.BytesIO(part[:length].numpy().tobytes()), weights_only=True)
            for part, length in zip(parts, lengths)]
