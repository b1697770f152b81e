"""The two-phase compressed allreduce: bytes per rank that do not grow with the number of ranks.

The allgather exchange hands every rank all ``P`` payloads of the whole group: it receives
``(P - 1) x`` the payload and decodes ``P x n`` elements. The two-phase exchange (as in
DeepSpeed's 1-bit Adam and CGX) splits the group into ``P`` chunks, one owned by each rank::

    phase 1   rank i compresses chunk j of acc = g + e (first-stage error feedback, as the
              allgather exchange keeps it) for every j; an all-to-all sends chunk j of every
              rank to rank j
    reduce    rank j validates the P payloads of its chunk, decodes and sums them in rank
              order 0..P-1 in float32 and divides by P
    phase 2   rank j compresses that average again, with a second error feedback e2_j kept
              by the chunk's owner; an allgather of the P compressed averages
    decode    every rank validates and decodes all P chunks into the group's gradient

Every rank decodes the same gathered bytes, so the result is bitwise the same on every rank.
Bytes handed to the collectives per rank: ``P x slot1`` (all-to-all, of which ``(P - 1) x
slot1`` leave the rank) plus ``slot2`` (allgather), about ``2 x`` the compressed size of ``n``
whatever ``P`` is (:mod:`gradcomp.costmodel` predicts them exactly).

Chunks. Chunk ``j`` holds elements ``[bounds[j], bounds[j + 1])`` of the flat group, with
sizes ``n // P`` or ``n // P + 1`` (:func:`chunk_bounds`). Every chunk's payload travels in a
slot of one fixed size, the largest of the chunks' payloads, zero-padded, so that both
collectives move equal blocks per rank. Phase 2 compresses float32 averages, so its layout is
the compressor's float32 layout whatever the gradient dtype. A group with fewer than ``P``
elements goes through the allgather exchange (the same decision on every rank).

Top-k's second stage re-selects ``k = ceil(density x chunk)`` entries per chunk from the
decoded average (plus the owner's residual e2): the average of ``P`` sparse payloads has up
to ``P x k`` non-zeros, and sending all of them would make phase 2 grow with ``P`` again. What
is not re-sent stays in e2 and goes out in later steps. 2-bit requantizes the average with the
same threshold rule (fixed ``t``, or ``RMS`` of the chunk in the ``"rms"`` mode).

Non-finite steps. Compressors keep a non-finite entry non-finite through compress and decode
(top-k selects it first, 2-bit gives it the non-finite code), so a non-finite gradient entry on
any rank makes its owner's average non-finite, then its phase-2 payload, then the decoded result
on every rank. The commit decision is taken from that final result, the same bytes everywhere:
a non-finite step commits neither the first-stage residuals (on any rank) nor the second-stage
residuals (on any owner).

Second-stage residuals are keyed by the group's parameter names, the world size and the chunk
index (:func:`owner_key`); they are part of :meth:`gradcomp.engine.Engine.state_dict` under
``"owner_residuals"``. A group whose parameters are regrouped (a DDP bucket rebuild after
compression started) starts its second stage from zero, which is logged.

Cost of the all-to-all: ``torch.distributed.all_to_all_single`` exists on Gloo (CPU) and NCCL;
the adapters' :meth:`~gradcomp.engine.Transport.all_to_all` waits for it, because phase 2 can
only be launched once the owned chunk has arrived, and launching it from a completion callback
would let ranks enqueue collectives in different orders. Phase 1 therefore does not overlap
with the rest of the backward pass; phase 2 does, as the allgather exchange does.
"""
from __future__ import annotations

import hashlib
import logging
import warnings
from typing import Callable, Dict, Hashable, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch

from gradcomp.compressors.base import Compressor
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import PayloadError, validate_payload

__all__ = ["EXCHANGES", "ExchangeContext", "check_exchange", "chunk_bounds", "chunk_layouts", "slot_nbytes",
           "phase2_slot_nbytes", "VERDICT_NBYTES", "owner_key", "TwoPhaseExchange"]

logger = logging.getLogger(__name__)

#: The exchanges of non-summable payloads an engine can use.
EXCHANGES = ("allgather", "two_phase")


def check_exchange(exchange) -> str:
    """``exchange`` if it names one of :data:`EXCHANGES`, else a ``ValueError`` that lists them."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    return exchange


class ExchangeContext(NamedTuple):
    """What the two-phase exchange needs of the engine, and nothing more.

    Attributes:
        transport: the :class:`gradcomp.engine.Transport` (``world_size``, ``rank``, collectives).
        backend: the kernel backend override (``None``: automatic).
        error_feedback: whether compressors that use error feedback keep residuals.
        record: ``record(group, bytes_sent, dense_bytes, compress_s, mode, backend)``, the telemetry.
        commit: ``commit(handle, average)``: commit the first-stage residuals (and a transform's
            state) of ``handle``'s group if ``average`` is finite; returns nothing.
    """

    transport: object
    backend: Optional[str]
    error_feedback: bool
    record: Callable
    commit: Callable


def chunk_bounds(numel: int, world_size: int) -> Tuple[int, ...]:
    """``P + 1`` offsets: chunk ``j`` is ``[bounds[j], bounds[j + 1])``; sizes ``n // P`` or ``n // P + 1``
    (the larger ones first), every chunk non-empty when ``n >= P``."""
    if world_size < 1 or numel < world_size:
        raise ValueError(f"two_phase needs at least one element per rank: numel={numel}, world_size={world_size}")
    base, extra = divmod(numel, world_size)
    return tuple(j * base + min(j, extra) for j in range(world_size + 1))


def chunk_layouts(compressor: Compressor, numel: int, world_size: int,
                  dtype: torch.dtype) -> Tuple[Tuple[PayloadLayout, ...], int]:
    """The payload layout of every chunk for ``dtype`` and the slot size (the largest ``nbytes``)."""
    bounds = chunk_bounds(numel, world_size)
    sizes = {bounds[j + 1] - bounds[j] for j in range(world_size)}
    by_size = {size: compressor.layout(size, dtype) for size in sizes}  # at most two distinct sizes
    layouts = tuple(by_size[bounds[j + 1] - bounds[j]] for j in range(world_size))
    return layouts, max(layout.nbytes for layout in by_size.values())


def slot_nbytes(compressor: Compressor, numel: int, world_size: int, dtype: torch.dtype) -> Tuple[int, int]:
    """``(slot1, slot2)``: the bytes of one chunk's slot in phase 1 (gradient ``dtype``) and phase 2
    (the verdict, then a float32 payload)."""
    return chunk_layouts(compressor, numel, world_size, dtype)[1], phase2_slot_nbytes(compressor, numel, world_size)


#: Bytes at the start of every phase-2 slot: the owner's verdict on the phase-1 chunks it received
#: (int32 ``[2]``: 1 if rejected, and the sending rank). Eight bytes, so that the bytes per rank stay
#: flat in the world size; the owner logs the reason itself.
VERDICT_NBYTES = 8


def phase2_slot_nbytes(compressor: Compressor, numel: int, world_size: int) -> int:
    """Bytes of one rank's phase-2 slot: the verdict, then the float32 layout's largest chunk payload."""
    return VERDICT_NBYTES + chunk_layouts(compressor, numel, world_size, torch.float32)[1]


def write_verdict(slot: torch.Tensor, sender: int, reason: str) -> None:
    """Write "the chunk from ``sender`` was rejected" into the first :data:`VERDICT_NBYTES` of the
    uint8 ``slot`` (mutated); ``reason`` goes to this rank's log."""
    logger.warning("gradcomp: the two-phase chunk sent by rank %d was rejected: %s", sender, reason)
    slot[:8].copy_(torch.tensor([1, sender], dtype=torch.int32).view(torch.uint8).to(slot.device))


def read_verdict(header: torch.Tensor, owner: int, world_size: int, group=None) -> None:
    """Raise the :class:`PayloadError` that ``owner``'s verdict header (uint8 ``[VERDICT_NBYTES]``)
    carries, naming the rank that sent the rejected chunk; return if the owner accepted its chunks.
    A header that is neither a verdict nor all zeros names ``owner`` itself as the culprit."""
    if not bool(header.any()):
        return
    flag, sender = header[:8].cpu().view(torch.int32).tolist()
    if flag != 1 or not 0 <= sender < world_size:
        raise PayloadError(f"a malformed verdict header in its two-phase slot (flag {flag}, sender {sender}) "
                           f"(group {group!r}, two-phase)", owner)
    raise PayloadError(f"its phase-1 chunk failed validation at rank {owner}, the owner of that chunk, whose log "
                       f"gives the reason (group {group!r}, two-phase)", sender)


def _parse_owner_key(name) -> Optional[Tuple[int, int]]:
    """``(chunk, world_size)`` of a name :func:`owner_key` made, else ``None``."""
    if not isinstance(name, str):
        return None
    parts = name.split(":")
    if len(parts) != 3 or parts[0] != "two_phase" or len(parts[1]) != 16 or "/" not in parts[2]:
        return None
    chunk, _, world_size = parts[2].partition("/")
    if not (chunk.isdigit() and world_size.isdigit()) or int(chunk) >= int(world_size):
        return None
    return int(chunk), int(world_size)


def owner_key(keys: Sequence[Hashable], world_size: int, chunk: int) -> str:
    """The name of the second-stage residual of ``chunk`` of the group of ``keys`` (a string, so
    that it survives a checkpoint; a digest of the parameter names keeps it short)."""
    digest = hashlib.blake2b(repr(tuple(keys)).encode(), digest_size=8).hexdigest()
    return f"two_phase:{digest}:{chunk}/{world_size}"


class TwoPhaseExchange:
    """The engine's two-phase exchange: launches both phases and keeps the owners' residuals.

    Held by :class:`gradcomp.engine.Engine` when ``exchange="two_phase"``; its ``start`` and
    ``finish`` take the engine's place for groups of mode ``"two_phase"``, given an
    :class:`ExchangeContext` rather than the engine. Mutates only the engine's first-stage
    residual memory (spare buffers, committed through ``context.commit`` in :meth:`finish`), its
    own :attr:`owner_memory`, the handle and the group's gradient.
    """

    def __init__(self):
        #: Second-stage residuals of the chunks this rank owns, keyed by :func:`owner_key`.
        self.owner_memory = ErrorFeedback()
        self._known_groups: Dict[str, Tuple[Hashable, ...]] = {}

    @staticmethod
    def applies(numel: int, world_size: int) -> bool:
        """Whether a group of ``numel`` elements can go two-phase (one element per rank at least)."""
        return world_size > 1 and numel >= world_size

    def start(self, context: ExchangeContext, handle, source: torch.Tensor,
              residuals: Optional[Tuple[torch.Tensor, torch.Tensor]], started: float) -> None:
        """Phases 1 and 2 up to the launch of the allgather (``handle.work``).

        Args:
            source: the compensated-to-be gradient ``[n]`` (float32/16/bf16), only read.
            residuals: ``(residual_in, residual_out)`` float32 ``[n]`` of the first stage, or ``None``.
            started: ``time.perf_counter()`` when compression started (telemetry).
        """
        import time

        from gradcomp.backends import resolve_backend

        transport, compressor, backend = context.transport, handle.compressor, context.backend
        world_size, rank, numel = transport.world_size, transport.rank, source.numel()
        bounds = chunk_bounds(numel, world_size)
        layouts1, slot1 = chunk_layouts(compressor, numel, world_size, source.dtype)
        outgoing = torch.zeros(world_size * slot1, dtype=torch.uint8, device=source.device)
        for j in range(world_size):
            lo, hi = bounds[j], bounds[j + 1]
            residual_in = residual_out = None
            if residuals is not None:
                residual_in, residual_out = residuals[0][lo:hi], residuals[1][lo:hi]
            payload = compressor.compress(source[lo:hi], residual_in, residual_out, backend=backend)
            outgoing[j * slot1: j * slot1 + payload.nbytes].copy_(payload.buffer)
        compress_s = time.perf_counter() - started

        incoming = transport.all_to_all(outgoing, f"{handle.group}.two_phase.1").reshape(-1).view(torch.uint8)
        if incoming.numel() != world_size * slot1:
            raise PayloadError(f"the all-to-all of group {handle.group!r} returned {incoming.numel()} bytes, "
                               f"expected {world_size} ranks x {slot1}; ranks disagree on the model, its dtypes "
                               "or the compressor settings")
        mine = bounds[rank + 1] - bounds[rank]
        slot2 = phase2_slot_nbytes(compressor, numel, world_size)
        wire = torch.zeros(slot2, dtype=torch.uint8, device=source.device)
        try:
            received = [self._checked(compressor, layouts1[rank], incoming, i, slot1, mine, handle.group)
                        for i in range(world_size)]
        except PayloadError as error:
            # Not raised here: the other ranks would wait in the phase-2 allgather. The verdict
            # travels in this rank's phase-2 slot and every rank raises it in finish().
            write_verdict(wire, error.rank, error.reason)
            handle.payload = None
            context.record(handle.group, world_size * slot1 + slot2, numel * source.element_size(),
                           compress_s, "two_phase", resolve_backend(source.device, backend))
            handle.work = transport.allgather(wire, f"{handle.group}.two_phase.2")
            return
        average = torch.zeros(mine, dtype=torch.float32, device=source.device)
        for payload in received:  # rank order: the same sum on every owner
            compressor.decompress_add(payload, average, backend)
        average.div_(world_size)

        started2 = time.perf_counter()
        key = owner_key(handle.keys, world_size, rank)
        self._note_group(key, handle.keys, mine)
        feedback = compressor.uses_error_feedback and context.error_feedback
        if feedback:
            owner_in, owner_out = self.owner_memory.buffers([key], [mine], source.device)
            reduced = compressor.compress(average, owner_in, owner_out, backend=backend)
        else:
            reduced = compressor.compress(average, backend=backend)
        wire[VERDICT_NBYTES: VERDICT_NBYTES + reduced.nbytes].copy_(reduced.buffer)
        compress_s += time.perf_counter() - started2
        handle.payload = reduced
        context.record(handle.group, world_size * slot1 + slot2, numel * source.element_size(),
                       compress_s, "two_phase", resolve_backend(source.device, backend))
        handle.work = transport.allgather(wire, f"{handle.group}.two_phase.2")

    def finish(self, context: ExchangeContext, handle, result: torch.Tensor) -> torch.Tensor:
        """Check every owner's verdict, validate and decode the gathered averages into ``handle.grad``;
        commit both stages if what ``handle.grad`` received (in its own dtype) is finite.

        Raises :class:`PayloadError` naming the sender, the same on every rank, when an owner
        rejected a phase-1 chunk (its verdict) or a phase-2 payload is malformed; nothing is then
        written and no residual of either stage is committed.
        """
        compressor, grad, backend = handle.compressor, handle.grad, context.backend
        world_size, rank, numel = context.transport.world_size, context.transport.rank, grad.numel()
        bounds = chunk_bounds(numel, world_size)
        layouts2, _ = chunk_layouts(compressor, numel, world_size, torch.float32)
        slot2 = phase2_slot_nbytes(compressor, numel, world_size)
        gathered = result.reshape(-1).view(torch.uint8)
        if gathered.numel() != world_size * slot2:
            raise PayloadError(f"the allgather of group {handle.group!r} returned {gathered.numel()} bytes, "
                               f"expected {world_size} ranks x {slot2}; ranks disagree on the model, its dtypes "
                               "or the compressor settings")
        for owner in range(world_size):  # owner order: every rank raises the same first verdict
            read_verdict(gathered[owner * slot2: owner * slot2 + VERDICT_NBYTES], owner, world_size, handle.group)
        payloads = [self._checked(compressor, layouts2[j], gathered, j, slot2, bounds[j + 1] - bounds[j],
                                  handle.group, VERDICT_NBYTES) for j in range(world_size)]
        out = grad if grad.dtype == torch.float32 else torch.empty(numel, dtype=torch.float32, device=grad.device)
        out.zero_()
        for j, payload in enumerate(payloads):
            compressor.decompress_add(payload, out[bounds[j]: bounds[j + 1]], backend)
        if out is not grad:
            grad.copy_(out)
        # The commit rule holds for what the model receives: an average finite in float32 that
        # overflows in the gradient's float16 rejects the step.
        accept = torch.isfinite(grad).all()
        context.commit(handle, grad)  # first stage (and a transform), from the same decision
        if compressor.uses_error_feedback and context.error_feedback:
            self.owner_memory.commit([owner_key(handle.keys, world_size, rank)], accept)
        return grad

    @staticmethod
    def _checked(compressor, layout: PayloadLayout, buffer: torch.Tensor, sender: int, slot: int, numel: int,
                 group, header: int = 0) -> Payload:
        """Sender's payload in its slot of ``buffer`` (after ``header`` bytes), validated (and its
        padding zero) before any decode."""
        block = buffer[sender * slot + header: (sender + 1) * slot]
        try:
            if layout.nbytes < block.numel() and bool(block[layout.nbytes:].any()):
                raise PayloadError("non-zero bytes in the padding of its two-phase slot", sender)
            payload = Payload(layout, block[: layout.nbytes])
            validate_payload(compressor, payload, numel, rank=sender)
        except PayloadError as error:
            raise PayloadError(f"{error.reason} (group {group!r}, two-phase)", error.rank) from error
        return payload

    def _note_group(self, key: str, keys: Tuple[Hashable, ...], numel: int) -> None:
        """Remember ``key``'s group; drop what no longer fits the layout: the second-stage residuals of
        groups that shared parameters with it (DDP rebuilt its buckets), which would otherwise be kept
        and saved for ever, and a loaded residual of another size than this chunk."""
        if key not in self._known_groups:
            stale = [k for k, held in self._known_groups.items() if set(held) & set(keys) and held != keys]
            if stale:
                self.owner_memory.drop(stale)
                for old in stale:
                    del self._known_groups[old]
                logger.info("gradcomp: two-phase groups regrouped (first: %r); their second-stage residuals "
                            "start from zero", keys[0])
            self._known_groups[key] = tuple(keys)
        held = self.owner_memory.residual(key)
        if held is not None and held.numel() != numel:
            self.owner_memory.drop([key])
            warnings.warn(f"gradcomp: the second-stage residual {key!r} has {held.numel()} elements, its chunk "
                          f"{numel}; it is dropped (was it loaded from a checkpoint of another layout?)")

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> Dict[str, torch.Tensor]:
        """``{owner_key: float32 1-D CPU tensor}``: the second-stage residuals this rank owns."""
        return self.owner_memory.state_dict()["residuals"]

    def prepare_load(self, residuals, world_size: int, rank: int) -> Callable[[], None]:
        """Validate saved second-stage residuals and return the function that assigns them.

        Each must be keyed by :func:`owner_key` for the saved ``world_size`` and the chunk the
        saved ``rank`` owns, and be a 1-D float tensor finite in float32; one whose group this
        exchange already knows must have that chunk's size. (A group not yet seen is checked at
        its first use, where a residual of the wrong size is dropped with a warning: raising
        there would be one rank deciding alone.) Raises ``ValueError``; changes nothing."""
        from gradcomp.checkpoint import check_float_vector

        if not isinstance(residuals, Mapping):
            raise ValueError(f"'owner_residuals' must be a dict of name -> tensor, got {type(residuals).__name__}")
        kept: Dict[str, torch.Tensor] = {}
        for name, value in residuals.items():
            parsed = _parse_owner_key(name)
            if parsed is None:
                raise ValueError(f"'owner_residuals' has an entry {name!r} that no two-phase exchange wrote")
            if parsed != (rank, world_size):
                raise ValueError(f"the second-stage residual {name!r} belongs to chunk {parsed[0]} of world size "
                                 f"{parsed[1]}, but the checkpoint was saved by rank {rank} of world size "
                                 f"{world_size}; the checkpoint is corrupt")
            check_float_vector(value, f"the second-stage residual {name!r}")
            live = self.owner_memory.residual(name)
            if live is not None and live.numel() != value.numel():
                raise ValueError(f"the second-stage residual {name!r} has {value.numel()} elements, its chunk "
                                 f"{live.numel()}; was the model or the world size changed?")
            kept[name] = value

        def assign() -> None:
            self.owner_memory.load_state_dict({"residuals": kept})

        return assign

    def reset(self) -> None:
        self.owner_memory.reset()

