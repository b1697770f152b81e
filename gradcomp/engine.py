"""The engine: one implementation of every step, shared by the DDP hook and the Horovod optimizer.

Where a change goes. A new compressor is a class in ``gradcomp/compressors/`` (stateless,
registered by name) with kernels in ``gradcomp/backends/`` and ``csrc/``; a new warm-up or
sparsity schedule goes in ``gradcomp/schedule.py`` and an optimizer-aware stage (DGC momentum)
in ``gradcomp/optim/``, both plugged into this engine through the ``schedule`` and
``transform`` slots; what happens to a gradient each step (the order below, error feedback,
the finite check, validation of received payloads, the settings check between ranks,
checkpoints) is written once, here; how a framework launches and awaits a collective is an
adapter's :class:`Transport` (``gradcomp/hooks/ddp.py`` for DDP, ``gradcomp/hooks/horovod/``
for Horovod), which should stay a translation of the framework's objects into engine calls.
Defaults and argument checks live in :mod:`gradcomp.settings`, counters in
:mod:`gradcomp.telemetry`.

Each step, for each *group* (a DDP bucket, a Horovod parameter or parameter group), given as
one flat gradient and the names of the parameters laid out in it::

    schedule        compressor = schedule.compressor_at(step, base)   (None: a dense step)
    transform       g = transform.before_compress(keys, numels, g)     (optional, e.g. DGC)
    compensate      acc = g + e                  e: fp32 residuals keyed by parameter name
    compress        payload, e' = C(acc)         one fused kernel; e' goes to a spare buffer
    exchange        allgather of fixed-size payloads (allreduce for summable payloads)
    validate        every received payload, before anything is written (gradcomp.validation)
    decode-average  sum of D(payload_r) for r = 0 .. P-1 in fp32, / P  (bitwise equal on every rank)
    commit          e <- e' only if the average is finite (on every rank, since all decode the same bytes)

A dense step (warm-up, a group under ``min_numel``, a compressor whose payload is the
gradient itself) adds the residuals still held for the group into the gradient ("flush", so
nothing held back is lost) and averages with the framework's own allreduce.

Public API::

    engine = Engine(compressor, transport, warmup_steps=2, min_numel=1024, error_feedback=True,
                    backend=None, schedule=None, transform=None, policy=None)
    #   policy: per-group choice of compressor, e.g. gradcomp.policy.Auto() (see that module)
    handle = engine.start(flat_grad, keys, numels, group)   # compress + launch; never waits
    #   handle.work is what the transport returned (a torch Future on DDP, a Horovod handle)
    averaged = engine.finish(handle, result)   # result: the collective's output tensor;
    #   validates, decodes, averages into flat_grad (returned), commits residuals; never waits
    engine.end_step()                          # after the last group of a step
    engine.step, engine.compressor, engine.schedule, engine.transform, engine.residual_memory,
    engine.stats(), engine.state_dict(), engine.load_state_dict(d, parameter_numels=...),
    engine.check_agreement(groups)             # the cross-rank settings check (one tiny collective)

``exchange="two_phase"`` (default ``"allgather"``) exchanges non-summable payloads in two phases
whose bytes per rank do not grow with the world size (:mod:`gradcomp.two_phase`; its phase 1
waits for an all-to-all inside ``start``).

``start`` and ``finish`` do not block: on DDP ``finish`` runs inside the future's ``.then``
(on a device, the finite check that decides the commit stays a device tensor). The only
blocking call is :meth:`Engine.check_agreement`, run at set-up and when DDP rebuilds its
buckets, never inside a ``.then``.

Extension slots (filled by :mod:`gradcomp.schedule` and :mod:`gradcomp.optim`):

* ``schedule``: ``compressor_at(step, base) -> Optional[Compressor]`` (``None``: dense; the
  result must be a function of ``step`` and ``base`` only, so that every rank agrees),
  ``state_dict()``, ``load_state_dict(d)`` (raises, changing nothing, if ``d`` does not fit).
  Default: :class:`gradcomp.schedule.DenseWarmup` of ``warmup_steps``.
* ``transform``: ``before_compress(keys, numels, g) -> g'``, ``after_compress(keys, payload,
  compressor, numel)``, ``dense(keys, numels, g) -> g'`` (all ``g`` float32 ``[n]``),
  ``commit(keys, accept)``, ``state_dict()``, ``load_state_dict(d)``. Default ``None``.
"""
from __future__ import annotations

import hashlib
import logging
import time
import warnings
from typing import Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from gradcomp.backends import BACKENDS, resolve_backend
from gradcomp.compressors.base import FLOAT_DTYPES, Compressor
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchange import average_gathered
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.settings import DEFAULT_MIN_NUMEL, DEFAULT_WARMUP_STEPS, check_backend, check_compressor, check_count
from gradcomp.telemetry import Telemetry
from gradcomp.two_phase import TwoPhaseExchange, check_exchange
from gradcomp.validation import PayloadError, validate_gathered

__all__ = ["Engine", "Handle", "Transport", "SettingsMismatchError", "STATE_FORMAT"]

logger = logging.getLogger(__name__)

#: The version of :meth:`Engine.state_dict`'s layout (recorded as ``"format"``).
STATE_FORMAT = 1

#: How a group's parameters share a compressed payload (see :class:`Engine`).
GRANULARITIES = ("parameter", "bucket")

#: What the ranks compare before they exchange anything (see :meth:`Engine.check_agreement`).
AGREEMENT_FIELDS = ("compressor", "error_feedback", "schedule", "transform", "min_numel", "world_size", "step",
                    "group_numels", "group_dtypes")


class SettingsMismatchError(RuntimeError):
    """Ranks were configured differently; raised on every rank before any gradient is exchanged."""


class Transport:
    """How an integration launches collectives. Subclassed by each adapter.

    Every method but :meth:`agree` only *launches* and returns the framework's work object,
    which the adapter awaits and hands to :meth:`Engine.finish` as a tensor.
    """

    world_size: int = 1
    rank: int = 0

    def allreduce_average(self, tensor: torch.Tensor, name: str):
        """Start averaging ``tensor`` in place over the ranks, exactly as the framework's own
        dense path does (DDP: multiply by 1/P, then sum; Horovod: ``op=Average``)."""
        raise NotImplementedError

    def allgather(self, buffer: torch.Tensor, name: str):
        """Start an allgather of the uint8 ``buffer`` (the same size on every rank); the
        result is ``[P * buffer.numel()]`` bytes, rank ``r``'s at ``r * buffer.numel()``."""
        raise NotImplementedError

    def all_to_all(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        """All-to-all of the uint8 ``buffer`` of ``P`` equal blocks, block ``j`` to rank ``j``; waits
        and returns uint8 ``[P * block]``, rank ``i``'s block for this rank at ``i * block``. Only
        the two-phase exchange (:mod:`gradcomp.two_phase`) needs it."""
        raise NotImplementedError(f"{type(self).__name__} has no all_to_all; use exchange='allgather'")

    def can_allreduce(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether ``allreduce_average`` can sum ``dtype`` tensors (else payloads are gathered)."""
        return True

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        """Blocking allgather of an int64 ``[F]`` CPU tensor; returns int64 ``[P, F]``."""
        raise NotImplementedError


class Handle:
    """One group's exchange in flight, from :meth:`Engine.start` to :meth:`Engine.finish`."""

    __slots__ = ("group", "keys", "numels", "grad", "mode", "compressor", "payload", "work", "scale")

    def __init__(self, group, keys, numels, grad, mode, compressor=None, payload=None):
        self.group: Hashable = group
        self.keys: Tuple[Hashable, ...] = keys
        self.numels: Tuple[int, ...] = numels
        self.grad: torch.Tensor = grad  # the flat gradient; receives the average
        self.mode: str = mode  # "dense" | "allreduce" | "allgather" | "two_phase"
        self.compressor: Optional[Compressor] = compressor
        self.payload: Optional[Payload] = payload
        self.work = None  # the transport's work object (a Future on DDP, a Horovod handle)
        self.scale = 1.0  # the loss scale the gradient arrived in (see Engine(grad_scaler=))


def _stable_hash(value) -> int:
    """A 63-bit hash of ``repr(value)``, the same in every process (``hash()`` is salted)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def spec_of(compressor: Optional[Compressor]) -> Optional[str]:
    """The compressor's registry spec (``"topk:0.01"``), or its repr where it has none."""
    if compressor is None:
        return None
    spec = getattr(compressor, "spec", None)
    return spec if isinstance(spec, str) else repr(compressor)


def _default_schedule(warmup_steps: int):
    from gradcomp.schedule import DenseWarmup

    return DenseWarmup(warmup_steps)


class Engine:
    """Runs every step of compressed data-parallel averaging; see the module docstring.

    Args:
        compressor: the base :class:`~gradcomp.Compressor`.
        transport: the integration's :class:`Transport` (may be set later, e.g. after unpickling).
        warmup_steps: dense steps before compression starts (the default schedule's length;
            not with ``schedule``). Default :data:`gradcomp.settings.DEFAULT_WARMUP_STEPS`.
        min_numel: groups with fewer elements go dense.
        error_feedback: keep residuals (only compressors with ``uses_error_feedback`` need them).
        backend: kernel backend override (``"torch"``, ``"numba"``, ``"cuda"``; else
            ``$GRADCOMP_BACKEND``, else automatic).
        schedule, transform: the extension slots of the module docstring.
        exchange: ``"allgather"`` or ``"two_phase"`` (:mod:`gradcomp.two_phase`), how payloads
            that cannot be summed travel.
        granularity: ``"parameter"`` (default): top-k keeps ``ceil(density * n_i)`` entries of
            each parameter and a 2-bit scale is per parameter, parameters under ``min_numel``
            travel dense in the same payload (:mod:`gradcomp.compressors.per_parameter`);
            ``"bucket"``: the whole group is one tensor. The two-phase exchange chunks the group
            and ignores it.
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision run. Each group is divided
            by its scale on arrival and the average multiplied back before the framework sees it,
            so residuals, DGC velocities and second-stage residuals hold true-gradient units and
            need no rescaling when the scale grows or backs off (GradScaler's scales are powers of
            two, so both operations are exact).
    """

    def __init__(self, compressor: Compressor, transport: Optional[Transport] = None, *,
                 warmup_steps: Optional[int] = None, min_numel: int = DEFAULT_MIN_NUMEL, error_feedback: bool = True,
                 backend: Optional[str] = None, schedule=None, transform=None, exchange: str = "allgather",
                 policy=None, granularity: str = "parameter", grad_scaler=None):
        self.compressor = check_compressor(compressor)
        #: The run's ``torch.amp.GradScaler``: gradients arrive multiplied by its scale; the engine
        #: works in the units of the true gradient so that residuals survive every scale change.
        self.grad_scaler = grad_scaler
        self._scale_at: Tuple[int, float] = (-1, 1.0)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        #: ``"parameter"``: each parameter of a group compressed on its own (:class:`PerParameter`);
        #: ``"bucket"``: the group as one tensor.
        self.granularity = granularity
        self._per_parameter: Dict[Tuple[int, Tuple[int, ...]], PerParameter] = {}
        #: Optional per-group choice of compressor (:class:`gradcomp.policy.Auto`): asked in ``start``
        #: for each group on compressed steps, told in ``finish`` when the group's collective completed.
        self.policy = policy
        if schedule is not None and warmup_steps is not None:
            raise ValueError("pass warmup_steps or a schedule, not both (a schedule has its own dense steps)")
        if schedule is None:
            schedule = _default_schedule(check_count("warmup_steps", DEFAULT_WARMUP_STEPS if warmup_steps is None
                                                     else warmup_steps))
        elif not callable(getattr(schedule, "compressor_at", None)):
            raise TypeError(f"schedule must have compressor_at(step, base), got {type(schedule).__name__}")
        if transform is not None:
            missing = [m for m in ("before_compress", "after_compress", "dense", "commit", "state_dict",
                                   "load_state_dict") if not callable(getattr(transform, m, None))]
            if missing:
                raise TypeError(f"transform {type(transform).__name__} lacks {missing}")
        self.min_numel = check_count("min_numel", min_numel)
        self.error_feedback = bool(error_feedback)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        self.backend = backend
        self.schedule = schedule
        self.transform = transform
        self.exchange = check_exchange(exchange)
        if self.exchange == "two_phase" and transform is not None:
            raise ValueError("exchange='two_phase' takes no optimizer-aware transform (its stages see whole "
                             "groups, two-phase compresses per chunk); use exchange='allgather'")
        #: The two-phase exchange and its second-stage residuals (``None`` with ``"allgather"``).
        self.two_phase = TwoPhaseExchange() if self.exchange == "two_phase" else None
        self.transport = transport
        self.residual_memory = ErrorFeedback()
        self.telemetry = Telemetry()
        self._step_compressor: Tuple[int, Optional[Compressor]] = (-1, None)
        self._compression_logged = False
        self._flush_logged = False
        #: Steps of this process (0: the first it runs, also after a resume) at whose groups the
        #: ranks compare settings before exchanging: DDP's first step and the one after its bucket
        #: rebuild. Empty: the adapter calls check_agreement itself.
        self.agreement_steps: Tuple[int, ...] = (0, 1)
        self._steps_run = 0

    # -- settings ----------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.telemetry.step

    @step.setter
    def step(self, value: int) -> None:
        self.telemetry.step = check_count("step", value)

    @property
    def warmup_steps(self) -> Optional[int]:
        """The schedule's dense steps (``None`` for a schedule without that notion)."""
        return getattr(self.schedule, "dense_steps", None)

    def check_backend(self, device) -> str:
        """Resolve the kernel backend for ``device`` now (argument, ``$GRADCOMP_BACKEND`` or automatic):
        adapters call it at set-up, so a bad name or a missing dependency fails before any step."""
        return check_backend(self.backend, device)

    def compressor_now(self) -> Optional[Compressor]:
        """The compressor of this step (``None``: a dense step), asked of the schedule once per step."""
        step, compressor = self._step_compressor
        if step != self.step:
            compressor = self.schedule.compressor_at(self.step, self.compressor)
            self._step_compressor = (self.step, compressor)
        return compressor

    def mode_of(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device) -> str:
        """``"dense"``, ``"allreduce"``, ``"allgather"`` or ``"two_phase"`` for a group (the same on every rank)."""
        if compressor is None or dtype not in FLOAT_DTYPES or numel < self.min_numel:
            return "dense"
        if compressor.summable:
            layout = compressor.layout(numel, dtype)
            if layout == PayloadLayout((("data", dtype, numel),)):
                return "dense"  # the payload is the gradient itself: the framework's own allreduce
            if self.transport is None or self.transport.can_allreduce(layout.segments[0].dtype, torch.device(device)):
                return "allreduce"
        if self.two_phase is not None and self.transport is not None and self.two_phase.applies(
                numel, self.transport.world_size):
            return "two_phase"
        return "allgather"

    # -- one group's exchange ----------------------------------------------------------
    def start(self, grad: torch.Tensor, keys: Sequence[Hashable], numels: Sequence[int], group: Hashable) -> Handle:
        """Compress ``grad`` and launch its collective; returns the :class:`Handle`.

        Args:
            grad: the group's flat contiguous gradient ``[n]`` (float32/16/bf16). It is
                mutated on dense steps (residuals added, scaled by the allreduce) and receives
                the average in :meth:`finish`; on compressed steps it is only read here.
            keys: the names of the parameters laid out in ``grad``, in order.
            numels: their element counts (sum ``n``).
            group: a name for telemetry and error messages (DDP: the bucket index).
        """
        keys, numels = tuple(keys), tuple(int(n) for n in numels)
        if sum(numels) != grad.numel():
            raise RuntimeError(f"group {group!r}: the gradient has {grad.numel()} elements, "
                               f"its parameters {sum(numels)}")
        if self._steps_run in self.agreement_steps:
            self.check_agreement([(numels, grad.dtype)], group)
        scale = self._loss_scale()
        if scale != 1.0:
            grad.div_(scale)
        compressor = self.compressor_now()
        if self.policy is not None:
            compressor = self.policy.choose(self, group, grad.numel(), grad.dtype, grad.device, compressor)
        mode = self.mode_of(compressor, grad.numel(), grad.dtype, grad.device)
        handle = Handle(group, keys, numels, grad, mode, compressor)
        handle.scale = scale
        dense_bytes = grad.numel() * grad.element_size()
        if mode == "dense":
            # The transform sees the gradient alone, then the residual is added, in the order of
            # a compressed step (acc = transform(g) + e): a DGC residual already holds velocity,
            # and must not pass through the momentum a second time.
            if self.transform is not None:
                grad.copy_(self.transform.dense(keys, numels, grad.float()))
            self._flush_residuals(keys, numels, grad)
            self.telemetry.record(group, dense_bytes, dense_bytes, 0.0, "dense")
            handle.work = self.transport.allreduce_average(grad, str(group))
            return handle

        if not self._compression_logged:
            self._compression_logged = True
            logger.info("gradcomp: compression starts at step %d with %r", self.step, compressor)
        started = time.perf_counter()
        source = grad if self.transform is None else self.transform.before_compress(keys, numels, grad.float())
        if mode == "two_phase":
            residuals = (self.residual_memory.buffers(keys, numels, grad.device)
                         if compressor.uses_error_feedback and self.error_feedback else None)
            self.two_phase.start(self, handle, source, residuals, started)
            return handle
        if mode == "allgather":
            compressor = handle.compressor = self._granular(compressor, numels)
        elif not compressor.uses_error_feedback:
            # A cast (fp16) keeps no residual: what a compressed step held back for this group
            # goes out now, as on a dense step (a policy may move a group from top-k to fp16).
            self._flush_residuals(keys, numels, source)
        if compressor.uses_error_feedback and self.error_feedback:
            residual_in, residual_out = self.residual_memory.buffers(keys, numels, grad.device)
            payload = compressor.compress(source, residual_in, residual_out, backend=self.backend)
        else:
            payload = compressor.compress(source, backend=self.backend)
        handle.payload = payload
        if self.transform is not None:
            self.transform.after_compress(keys, payload, compressor, grad.numel())
        if mode == "allreduce":  # a summable payload: one segment, summed in place by the allreduce
            wire = payload["data"]
            self.telemetry.record(group, wire.numel() * wire.element_size(), dense_bytes,
                                  time.perf_counter() - started, mode, None)
            handle.work = self.transport.allreduce_average(wire, str(group))
        else:
            self.telemetry.record(group, payload.nbytes, dense_bytes, time.perf_counter() - started, mode,
                                  resolve_backend(grad.device, self.backend))
            handle.work = self.transport.allgather(payload.buffer, str(group))
        return handle

    def finish(self, handle: Handle, result: torch.Tensor) -> torch.Tensor:
        """Write the average of ``handle``'s group into its gradient and return the gradient.

        The average is in the loss scale the gradient arrived in (see ``grad_scaler``).

        ``result`` is the collective's output: the reduced tensor (dense, allreduce) or the
        gathered payloads (allgather; any integer view of the ``P * nbytes`` bytes). Gathered
        payloads are validated before anything is written; a bad one raises
        :class:`~gradcomp.validation.PayloadError` naming the sender and the group, and leaves
        the gradient and the residuals as they were. Never blocks.
        """
        average = self._average(handle, result)
        if handle.scale != 1.0:
            average.mul_(handle.scale)
        return average

    def _average(self, handle: Handle, result: torch.Tensor) -> torch.Tensor:
        """:meth:`finish` in the units of the true gradient."""
        grad, mode = handle.grad, handle.mode
        if self.policy is not None:
            self.policy.finished(handle)
        if mode == "two_phase":
            return self.two_phase.finish(self, handle, result)
        if mode == "dense":
            if result.data_ptr() != grad.data_ptr():
                grad.copy_(result.view(-1))
            self._commit(handle, grad)
            return grad
        payload = handle.payload
        if mode == "allreduce":
            data = payload["data"]
            if result.data_ptr() != data.data_ptr():
                data.copy_(result.view(-1))
            handle.compressor.decompress(payload, grad, self.backend)
            self._commit(handle, grad)
            return grad

        layout = payload.layout
        gathered = result.reshape(-1).view(torch.uint8)
        world_size = gathered.numel() // max(layout.nbytes, 1)
        if gathered.numel() != world_size * layout.nbytes or (self.transport is not None
                                                              and world_size != self.transport.world_size):
            raise PayloadError(
                f"the allgather of group {handle.group!r} returned {gathered.numel()} bytes, expected "
                f"{self.transport.world_size if self.transport else '?'} ranks x {layout.nbytes}; ranks disagree "
                "on the model, its dtypes or the compressor settings"
            )
        try:
            validate_gathered(handle.compressor, layout, gathered, grad.numel())
        except PayloadError as error:
            raise PayloadError(f"{error.reason} (group {handle.group!r})", error.rank) from error
        out = grad if grad.dtype == torch.float32 else torch.empty(grad.numel(), dtype=torch.float32,
                                                                    device=grad.device)
        average_gathered(handle.compressor, layout, gathered, out, self.backend)
        self._commit(handle, out)
        if out is not grad:
            grad.copy_(out)
        return grad

    def _commit(self, handle: Handle, average: torch.Tensor) -> None:
        """Commit ``e'`` (and the transform's state) only if ``average`` is finite; the
        decision stays a device tensor, read at the next use of these residuals."""
        compressed = handle.mode != "dense"
        feedback = compressed and handle.compressor.uses_error_feedback and self.error_feedback
        if not feedback and self.transform is None:
            return
        accept = torch.isfinite(average).all()
        if feedback:
            self.residual_memory.commit(handle.keys, accept)
        if self.transform is not None:
            self.transform.commit(handle.keys, accept)

    def _loss_scale(self) -> float:
        """The grad scaler's scale this step (read once per step; 1.0 without a scaler)."""
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        step, scale = self._scale_at
        if step != self.step:
            scale = float(scaler.get_scale())
            if not (scale > 0 and scale != float("inf")):
                raise RuntimeError(f"the grad scaler's scale is {scale}; it must be a positive finite number")
            self._scale_at = (self.step, scale)
        return scale

    def end_step(self) -> None:
        """Close the step: telemetry moves on and the schedule sees the next step number."""
        self.telemetry.end_step()
        self._steps_run += 1

    def _granular(self, compressor: Compressor, numels: Tuple[int, ...]) -> Compressor:
        """``compressor`` for a group of parameters of ``numels``: per parameter (cached per
        compressor and layout) or whole, by :attr:`granularity`."""
        if self.granularity == "bucket" or len(numels) < 2:
            return compressor
        key = (id(compressor), numels)
        wrapped = self._per_parameter.get(key)
        if wrapped is None or wrapped.base is not compressor:
            if len(self._per_parameter) > 256:  # schedules make a few compressors; bound the cache anyway
                self._per_parameter.clear()
            wrapped = self._per_parameter[key] = PerParameter(compressor, numels, dense_below=self.min_numel)
        return wrapped

    def _flush_residuals(self, keys, numels, grad: torch.Tensor) -> None:
        """Add the residuals still held for ``keys`` into ``grad`` and zero them, so a group
        that goes dense after being compressed loses nothing it held back."""
        if not self.residual_memory.keys():
            return
        offset, flushed = 0, []
        for key, n in zip(keys, numels):
            residual = self.residual_memory.residual(key)
            if residual is not None:
                if residual.numel() != n:
                    raise RuntimeError(f"the residual of {key!r} has {residual.numel()} elements, its gradient {n}")
                grad[offset: offset + n].add_(residual.to(grad.dtype))
                residual.zero_()
                flushed.append(key)
            offset += n
        if flushed and not self._flush_logged:
            self._flush_logged = True
            logger.info("gradcomp: residuals of %d parameters flushed into a dense step at step %d (first: %r)",
                        len(flushed), self.step, flushed[0])

    # -- agreement between ranks -------------------------------------------------------
    def settings_fingerprint(self, groups: Sequence[Tuple[Sequence[int], torch.dtype]]) -> Dict[str, object]:
        """The settings every rank must share, by field (:data:`AGREEMENT_FIELDS`); backend-independent."""
        schedule = self.schedule.state_dict() if callable(getattr(self.schedule, "state_dict", None)) else None
        return {
            # How the compressor is chosen and exchanged travels with it: ranks that exchange
            # differently, or where only some run a policy (it adds collectives), would hang.
            "compressor": spec_of(self.compressor) + ("" if self.exchange == "allgather"
                                                      else f" exchange={self.exchange}")
            + ("" if self.granularity == "parameter" else f" granularity={self.granularity}")
            + ("" if self.policy is None else f" policy={type(self.policy).__name__}{self._policy_settings()}"),
            "error_feedback": self.error_feedback and self.compressor.uses_error_feedback,
            "schedule": (type(self.schedule).__name__, schedule),
            "transform": None if self.transform is None else type(self.transform).__name__,
            "min_numel": self.min_numel,
            "world_size": self.transport.world_size if self.transport is not None else 1,
            "step": self.step,  # the schedule's position: ranks resumed from different checkpoints differ here
            "group_numels": tuple(tuple(int(n) for n in numels) for numels, _ in groups),
            "group_dtypes": tuple(str(dtype) for _, dtype in groups),
        }

    def _policy_settings(self) -> object:
        return self.policy.state_dict() if callable(getattr(self.policy, "state_dict", None)) else None

    def check_agreement(self, groups: Sequence[Tuple[Sequence[int], torch.dtype]], where: Hashable = None) -> None:
        """Compare the settings fingerprint across ranks with one tiny allgather (blocking).

        Raises :class:`SettingsMismatchError` on every rank, naming each differing setting,
        which ranks hold which variant and this rank's value. Call it at the same point on
        every rank (the engine does so at the groups of :attr:`agreement_steps`).
        """
        if self.transport is None or self.transport.world_size == 1:
            return
        fields = self.settings_fingerprint(groups)
        local = torch.tensor([_stable_hash(fields[name]) for name in AGREEMENT_FIELDS], dtype=torch.int64)
        gathered = self.transport.agree(local).view(-1, len(AGREEMENT_FIELDS))
        self.telemetry.record_agreement(local.numel() * local.element_size())
        differing = []
        for column, name in enumerate(AGREEMENT_FIELDS):
            values = gathered[:, column].tolist()
            if len(set(values)) > 1:
                variants: Dict[int, list] = {}
                for rank, value in enumerate(values):
                    variants.setdefault(value, []).append(rank)
                sides = " vs ".join(f"ranks {ranks}" for ranks in variants.values())
                differing.append(f"{name} ({sides}; rank {self.transport.rank} has {fields[name]!r})")
        if differing:
            place = f" at group {where!r}" if where is not None else ""
            raise SettingsMismatchError(
                f"gradcomp: ranks disagree on {', '.join(differing)}{place}. Every rank must use the same "
                "compressor and settings, model and dtypes; nothing was exchanged."
            )
        if self.step > 0 and where is not None:
            logger.debug("gradcomp: settings agree across ranks at group %r, step %d", where, self.step)

    # -- telemetry and checkpoints -----------------------------------------------------
    def stats(self) -> dict:
        """See :meth:`gradcomp.telemetry.Telemetry.stats`; with a policy also ``"policy"``
        (:meth:`gradcomp.policy.Auto.stats`)."""
        stats = self.telemetry.stats()
        if self.policy is not None:
            stats["policy"] = self.policy.stats()
        return stats

    def state_dict(self, residual_names: Optional[Mapping[Hashable, str]] = None) -> dict:
        """This rank's state, the same format on DDP and Horovod (``torch.load(weights_only=True)`` safe):

        ``{"format": 1, "step": int, "world_size": int, "rank": int, "compressor": spec str,
        "schedule": schedule.state_dict(), "transform": transform.state_dict() or None,
        "residuals": {parameter name: float32 1-D tensor on CPU}}``. Residuals are one rank's
        private error: save every rank's state.
        """
        transport = self.transport
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "world_size": transport.world_size if transport is not None else 1,
            "rank": transport.rank if transport is not None else 0,
            "compressor": spec_of(self.compressor),
            "schedule": self.schedule.state_dict() if callable(getattr(self.schedule, "state_dict", None)) else None,
            "transform": self.transform.state_dict() if self.transform is not None else None,
            "residuals": self.residual_memory.state_dict()["residuals"],
            **({"owner_residuals": self.two_phase.state_dict()} if self.two_phase is not None else {}),
        }

    def load_state_dict(self, state_dict, parameter_numels: Optional[Mapping[str, int]] = None,
                        unknown_residuals: str = "raise") -> None:
        """Restore :meth:`state_dict` transactionally (see :meth:`prepare_load`)."""
        self.prepare_load(state_dict, parameter_numels, unknown_residuals)()

    def prepare_load(self, state_dict, parameter_numels: Optional[Mapping[str, int]] = None,
                     unknown_residuals: str = "raise") -> Callable[[], None]:
        """Validate :meth:`state_dict`'s output and return the function that assigns it.

        An adapter that loads more than the engine (the Horovod optimizer's own state) validates
        every part before it assigns any. Loading is transactional: everything is validated, then assigned.

        Validated first: the types, ``step``/``world_size``/``rank`` as integers, every residual a
        finite 1-D float tensor whose numel equals its parameter's (``parameter_numels``: name ->
        numel, where the adapter knows the parameters), the schedule (its ``load_state_dict``
        must raise without changing anything when it does not fit) and the transform. A rejected
        load raises ``ValueError`` and leaves the live state exactly as it was.

        Residuals whose name matches no parameter raise (``unknown_residuals="warn"``: warn and
        drop them). A checkpoint of another world size or rank, or of another compressor
        (``"compressor"`` spec), loads with a warning and zero residuals: each residual is one
        rank's private error of one compressor. Checkpoints of format 0 (no ``format``,
        ``rank``, ``compressor`` or ``schedule`` keys) load as well.
        """
        if unknown_residuals not in ("raise", "warn"):
            raise ValueError(f"unknown_residuals must be 'raise' or 'warn', got {unknown_residuals!r}")
        if not isinstance(state_dict, Mapping):
            raise ValueError(f"expected the dict from state_dict(), got {type(state_dict).__name__}")
        missing = {"step", "world_size", "residuals"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict lacks {sorted(missing)}; pass the dict from state_dict()")
        fmt = state_dict.get("format", 0)
        if fmt not in (0, STATE_FORMAT):
            raise ValueError(f"state_dict format {fmt!r} is not one this version reads (0, {STATE_FORMAT})")
        step = _int_field(state_dict, "step", 0)
        world_size = _int_field(state_dict, "world_size", 1)
        rank = _int_field(state_dict, "rank", 0) if "rank" in state_dict else None
        residuals = state_dict["residuals"]
        if not isinstance(residuals, Mapping):
            raise ValueError(f"'residuals' must be a dict of parameter name -> tensor, got {type(residuals).__name__}")
        kept = {}
        for name, value in residuals.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
                what = f"{type(value).__name__}{shape}"
                raise ValueError(f"the residual of {name!r} must be a 1-D float tensor, got {what}")
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"the residual of {name!r} is not finite; the checkpoint is corrupt")
            if parameter_numels is not None:
                if name not in parameter_numels:
                    if unknown_residuals == "raise":
                        raise ValueError(
                            f"the checkpoint has a residual for {name!r}, which is no parameter of this model "
                            "(pass unknown_residuals='warn' to drop such residuals with a warning)"
                        )
                    warnings.warn(f"gradcomp: dropped the residual of {name!r}, which is no parameter of this model")
                    continue
                if value.numel() != parameter_numels[name]:
                    raise ValueError(f"the residual of {name!r} has {value.numel()} elements but the parameter "
                                     f"has {parameter_numels[name]}; was the model changed?")
            kept[name] = value
        saved_spec = state_dict.get("compressor")
        if saved_spec is not None and not isinstance(saved_spec, str):
            raise ValueError(f"'compressor' must be a spec string, got {type(saved_spec).__name__}")
        transport = self.transport
        here = (transport.world_size, transport.rank) if transport is not None else (1, 0)
        saved_schedule = state_dict.get("schedule")
        if saved_schedule is not None and callable(getattr(self.schedule, "load_state_dict", None)):
            self.schedule.load_state_dict(saved_schedule)  # checks; raises without changing anything
        saved_transform = state_dict.get("transform")
        if (saved_transform is None) != (self.transform is None) and fmt != 0:
            raise ValueError("the checkpoint was saved " + ("without" if saved_transform is None else "with")
                             + " an optimizer-aware transform and this run " + ("has one" if saved_transform is None
                                                                                 else "has none"))
        reset_reason = None
        if world_size != here[0] or (rank is not None and rank != here[1]):
            saved_at = f"rank {rank} of " if rank is not None else ""
            reset_reason = (f"the checkpoint was saved by {saved_at}world size {world_size} and is loaded by rank "
                            f"{here[1]} of world size {here[0]}")
        elif saved_spec is not None and saved_spec != spec_of(self.compressor):
            reset_reason = (f"the checkpoint's residuals were made by {saved_spec!r}, "
                            f"this run uses {spec_of(self.compressor)!r}")

        saved_owners = state_dict.get("owner_residuals")
        assign_owners = None
        if self.two_phase is not None and saved_owners is not None and reset_reason is None:
            assign_owners = self.two_phase.prepare_load(saved_owners)  # checks; changes nothing
        elif self.two_phase is None and saved_owners:
            warnings.warn("gradcomp: the checkpoint holds second-stage residuals of the two-phase exchange; "
                          "this run uses exchange='allgather' and drops them")

        def assign() -> None:
            # The transform's own load comes first: if it refuses, nothing else has changed.
            if self.transform is not None and saved_transform is not None:
                self.transform.load_state_dict(saved_transform)
            self.step = step
            if reset_reason is not None:
                if kept:
                    warnings.warn(f"gradcomp: {reset_reason}; error-feedback residuals are reset to zero")
                self.residual_memory.reset()
            else:
                self.residual_memory.load_state_dict({"residuals": kept})
            if self.two_phase is not None:
                if assign_owners is not None:
                    assign_owners()
                else:
                    self.two_phase.reset()

        return assign

    def __getstate__(self):
        state = dict(self.__dict__)
        state["transport"] = None  # process groups and Horovod handles do not cross processes
        return state


def _int_field(state_dict, name: str, minimum: int) -> int:
    value = state_dict[name]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}, got {value!r}")
    return value
