"""Gloo's allgather with every receive posted before any send: a late rank no longer delays its own receive.

Why. A Gloo TCP pair sends a message only after the receiver has announced a buffer for it, and the
announcement travels on the same stream as the payloads. Gloo's allgather sends first, then receives.
A rank that starts it after its peer finds the peer already announced, writes its own payload into the
socket (as far as the socket's send buffer takes it), and only then its announcement: the peer's payload
waits behind the late rank's own. Over an emulated 10 Mbit/s link, a rank 30 ms late received a
121,000-byte payload 48 ms after its time at the rate, a 50,000-byte one 19 ms after, in every repeat;
with the receives posted first both ranks received at the rate
(``experiments/results/link-emulation/late_rank.py``). In training the wait keeps itself going: the rank that
received last starts its next step last. Over consecutive steps of charlm-small's 2-bit recipe at 10 Mbit/s the
later rank started 47-81 ms after the other through Gloo's allgather and 1-3 ms through this one, and the step
fell from 258-292 to 213-223 ms (two runs, ``steady_steps.py`` there).

:func:`gather` posts the receives from every peer, then the sends to every peer, as point-to-point works.
Gloo's point-to-point works have no future, so one daemon thread of this module (:class:`Completions`)
waits for them in the order they were started and completes the future handed back; the future's
callbacks (the engine's finish) run on that thread, as they ran on Gloo's. The works are posted by another
daemon thread (:class:`Posts`), not in the hook: a Gloo pair's send and receive take the pair's lock, and its
event loop thread, woken by the peer's bytes while the lock is held, spins on it (``Pair::handleEvents`` tries
the lock and returns, the readable socket wakes it again) and takes the holder's core. On the unshaped
loopback, 2 ranks on 2 shared cores (the shapes CNN), a third of the hook's receives took 1-12 ms against 0.15 ms
for the rest, the training thread waiting them out inside backward while the loop thread ran; posted by this
thread, the compressed step took 0.82-0.96x its time, paired, with another job on the cores, and 0.99x with the
ranks alone; the same bytes received (``experiments/results/research-step-overhead/``).

Every rank sends its payload to each of its ``P - 1`` peers: the bytes each rank sends and receives are the
ring's, ``(P - 1) x n``, but all at once on ``P - 1`` streams, so beyond :data:`MAX_RANKS` ranks the ring (Gloo's
own allgather) keeps its place.
"""
from __future__ import annotations

import atexit
import queue
import threading
import zlib
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from gradcomp import inflight

__all__ = ["MAX_RANKS", "Completions", "Posts", "applies", "gather", "tag_of"]

#: The most ranks the direct form serves; beyond, each rank's ``P - 1`` simultaneous streams are left to
#: the ring. Tested at 2 and 3 ranks, timed at 2.
MAX_RANKS = 8
#: Point-to-point tags of gradcomp's exchanges: this base plus 16 bits of the group's name, the same on
#: every rank (a user's own ``isend``/``irecv`` use small tags, 0 by default).
TAG_BASE = 0x6763 << 16
#: How long the interpreter's exit waits for the completion thread to finish what it was handed.
STOP_WAIT_S = 5.0


class _Worker:
    """One daemon thread that handles the items handed to it in order (started at the first item)."""

    name = "gradcomp-direct"

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def _put(self, item: tuple) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                self._started()
        self._queue.put(item)

    def _started(self) -> None:
        """Called once the thread has started."""

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._handle(*item)
            # What the item held (works, tensors, callbacks) went in _handle, on this Python thread.
            del item

    def _handle(self, *item) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Let the thread finish what it was handed, then end it (at exit, before finalization)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)


class Completions(_Worker):
    """One daemon thread that waits for point-to-point works in the order they were started and then
    completes their future: with ``value``, or with the first work's error (a failed peer). Stopped at exit by
    the :class:`Posts` that hands it works."""

    def add(self, works: List[object], future: torch.futures.Future, value: object,
            error: Optional[BaseException] = None) -> None:
        """Complete ``future`` with ``value`` (or ``error``, if given) once every work of ``works`` has finished."""
        self._put((works, future, value, error))

    def _handle(self, works, future, value, error) -> None:
        _complete(works, future, value, error)


class Posts(_Worker):
    """One daemon thread that posts each exchange's point-to-point works, in the order the exchanges were
    handed to it, and passes them on to ``completions``: the caller never holds a Gloo pair's lock (module
    docstring)."""

    name = "gradcomp-direct-post"

    def __init__(self, completions: Completions):
        super().__init__()
        self._completions = completions

    def add(self, post: Callable[[List[object]], None], future: torch.futures.Future, value: object) -> None:
        """Run ``post(works)`` (it appends each work it starts to ``works``), then complete ``future`` with
        ``value`` once they have finished; an error in ``post`` fails the future after the works it started."""
        self._put((post, future, value))

    def _started(self) -> None:
        # At exit this runs before gradcomp.inflight's wait, whose hook the first hold() registered.
        atexit.register(self.stop)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """Post what was handed, then let the completion thread finish (at exit, before finalization)."""
        super().stop(timeout_s)
        self._completions.stop(timeout_s)

    def _handle(self, post, future, value) -> None:
        works: List[object] = []
        try:
            post(works)
        except Exception as failure:  # e.g. a peer that left: the future raises it on the training thread
            self._completions.add(works, future, value, failure)
            return
        self._completions.add(works, future, value)


def _complete(works: List[object], future: torch.futures.Future, value: object,
              error: Optional[BaseException] = None) -> None:
    """Wait for every work of ``works`` in order, then complete ``future`` (with ``error`` or the works' first
    error, if any: the engine's wait re-raises it on the training thread); on return nothing here refers to them."""
    for work in works:
        try:
            work.wait()
        except Exception as failure:  # a failed peer: the other works are still waited for before they go
            error = error or failure
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


_COMPLETIONS = Completions()
_POSTS = Posts(_COMPLETIONS)


def applies(group, world_size: int, buffer: torch.Tensor) -> bool:
    """Whether :func:`gather` serves ``buffer`` on ``group``: Gloo, a CPU tensor, 2 to :data:`MAX_RANKS` ranks."""
    return 2 <= world_size <= MAX_RANKS and buffer.device.type == "cpu" and dist.get_backend(group) == "gloo"


def tag_of(name: str) -> int:
    """The point-to-point tag of the group ``name``: the same on every rank."""
    return TAG_BASE + (zlib.crc32(name.encode()) & 0xFFFF)


def gather(buffer: torch.Tensor, group, rank: int, world_size: int, name: str) -> torch.futures.Future:
    """Start gathering the 1-D uint8 ``buffer`` (the same size on every rank) of every rank of ``group``;
    the future's value is ``[gathered]``, uint8 ``[world_size * n]`` with rank ``r``'s bytes at ``r * n``.
    Returns at once: a thread of this module posts the receives from every peer, then the sends (module
    docstring), in the order of the calls. ``buffer`` must not change until the future
    completes. The ranks agree on every payload's size at set-up (:mod:`gradcomp.agreement`); a peer that sent
    another size would end the process inside Gloo, as Gloo's own allgather does. A peer that leaves fails the
    future."""
    n = buffer.numel()
    gathered = torch.empty(world_size * n, dtype=torch.uint8)
    gathered[rank * n:(rank + 1) * n].copy_(buffer)
    peers = [(rank + i) % world_size for i in range(1, world_size)]
    # Aliases held until the works let go of them, as for every collective (see gradcomp.inflight).
    sent, *slots = inflight.hold(buffer, *(gathered[peer * n:(peer + 1) * n] for peer in peers))
    tag = tag_of(name)

    def post(works: List[object]) -> None:  # on the posting thread (module docstring)
        works.extend(dist.irecv(slot, group=group, group_src=peer, tag=tag) for peer, slot in zip(peers, slots))
        works.extend(dist.isend(sent, group=group, group_dst=peer, tag=tag) for peer in peers)

    future: torch.futures.Future = torch.futures.Future()
    _POSTS.add(post, future, [gathered])
    return future
