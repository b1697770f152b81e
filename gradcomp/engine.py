"""The engine: one implementation of every step, shared by the DDP hook and the Horovod optimizer.

Where a change goes. A new compressor is a class in ``gradcomp/compressors/`` (stateless,
registered by name) with kernels in ``gradcomp/backends/`` and ``csrc/``; a new warm-up or
sparsity schedule goes in ``gradcomp/schedule.py`` and an optimizer-aware stage (DGC momentum)
in ``gradcomp/optim/``, both plugged into this engine through the ``schedule`` and
``transform`` slots; what happens to a gradient each step (the order below, error feedback,
the finite check, validation of received payloads) is written once, here; the settings check
between ranks lives in :mod:`gradcomp.agreement` and checkpoint validation in
:mod:`gradcomp.checkpoint` (the engine's methods of those names delegate); how a framework
launches and awaits a collective is an adapter's :class:`Transport` (``gradcomp/hooks/ddp.py``
for DDP, ``gradcomp/hooks/horovod/`` for Horovod), which should stay a translation of the
framework's objects into engine calls. Defaults and argument checks live in :mod:`gradcomp.settings`, counters in
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

import logging
import time
from typing import Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from gradcomp import agreement, checkpoint
from gradcomp.agreement import AGREEMENT_FIELDS, SettingsMismatchError, spec_of
from gradcomp.backends import BACKENDS, resolve_backend
from gradcomp.checkpoint import STATE_FORMAT
from gradcomp.compressors.base import FLOAT_DTYPES, Compressor
from gradcomp.compressors.per_parameter import PerParameter
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchange import average_gathered
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.settings import DEFAULT_MIN_NUMEL, DEFAULT_WARMUP_STEPS, check_backend, check_compressor, check_count
from gradcomp.telemetry import Telemetry
from gradcomp.two_phase import ExchangeContext, TwoPhaseExchange, check_exchange
from gradcomp.validation import PayloadError, validate_gathered

__all__ = ["Engine", "Handle", "Transport", "SettingsMismatchError", "STATE_FORMAT", "AGREEMENT_FIELDS", "spec_of"]

logger = logging.getLogger(__name__)

#: How a group's parameters share a compressed payload (see :class:`Engine`).
GRANULARITIES = ("parameter", "bucket")


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
            self.two_phase.start(self._exchange_context(), handle, source, residuals, started)
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
            return self.two_phase.finish(self._exchange_context(), handle, result)
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
        if out is not grad:
            grad.copy_(out)
        self._commit(handle, grad)  # on what the model receives: a float16 overflow rejects the step
        return grad

    def _exchange_context(self) -> ExchangeContext:
        """The narrow view of this engine that an exchange object gets (the transport may be set late)."""
        return ExchangeContext(self.transport, self.backend, self.error_feedback, self.telemetry.record, self._commit)

    def _commit(self, handle: Handle, average: torch.Tensor) -> None:
        """Commit ``e'`` (and the transform's state) only if ``average`` is finite; the
        decision stays a device tensor, read at the next use of these residuals.

        ``average`` is what the group's gradient received, in the gradient's dtype (every
        exchange passes the gradient itself after the write), so a result finite in float32
        that overflows in float16 commits nothing."""
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

    # -- agreement between ranks (gradcomp.agreement) ---------------------------------
    def settings_fingerprint(self, groups: Sequence[Tuple[Sequence[int], torch.dtype]]) -> Dict[str, object]:
        """See :func:`gradcomp.agreement.settings_fingerprint`."""
        return agreement.settings_fingerprint(self, groups)

    def check_agreement(self, groups: Sequence[Tuple[Sequence[int], torch.dtype]], where: Hashable = None) -> None:
        """The cross-rank settings check (blocking); see :func:`gradcomp.agreement.check_agreement`."""
        agreement.check_agreement(self, groups, where)

    # -- telemetry and checkpoints -----------------------------------------------------
    def stats(self) -> dict:
        """See :meth:`gradcomp.telemetry.Telemetry.stats`; with a policy also ``"policy"``
        (:meth:`gradcomp.policy.Auto.stats`)."""
        stats = self.telemetry.stats()
        if self.policy is not None:
            stats["policy"] = self.policy.stats()
        return stats

    def state_dict(self) -> dict:
        """This rank's state; the format is :func:`gradcomp.checkpoint.state_dict`'s."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state_dict, parameter_numels: Optional[Mapping[str, int]] = None,
                        unknown_residuals: str = "raise") -> None:
        """Restore :meth:`state_dict` transactionally (see :meth:`prepare_load`)."""
        self.prepare_load(state_dict, parameter_numels, unknown_residuals)()

    def prepare_load(self, state_dict, parameter_numels: Optional[Mapping[str, int]] = None,
                     unknown_residuals: str = "raise") -> Callable[[], None]:
        """Validate :meth:`state_dict`'s output and return the function that assigns it
        (:func:`gradcomp.checkpoint.prepare_load`)."""
        return checkpoint.prepare_load(self, state_dict, parameter_numels, unknown_residuals)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["transport"] = None  # process groups and Horovod handles do not cross processes
        return state

