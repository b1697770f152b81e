"""The engine: one implementation of every step, shared by the DDP hook and the Horovod optimizer.

What happens to a gradient each step (the order below, error feedback, the finite check and the
commit) is written once, here; how a group's payloads travel and are validated is its exchange's
(:mod:`gradcomp.exchanges`), the settings check between ranks :mod:`gradcomp.agreement`,
checkpoints :mod:`gradcomp.checkpoint`, what adapters implement :mod:`gradcomp.transport` (the
README's "Where a change goes" has the whole map).

Each step, for each *group* (a DDP bucket, a Horovod parameter or parameter group), given as
one flat gradient and the names of the parameters laid out in it::

    schedule        compressor = schedule.compressor_at(step, base)   (None: a dense step)
    policy          compressor = policy.choose(...)                    (optional, e.g. Auto)
    exchange        the first of the engine's chain of exchanges that applies; compressor = exchange.granular(...)
    transform       g = transform.before_compress(keys, numels, g, compressor)  (optional)
    compensate      e: fp32 residuals keyed by parameter name, handed to the exchange's compress
    compress        payload, e' = C(g + e)       one fused kernel; e' goes to a spare buffer
    launch          the exchange's collective (allgather of fixed-size payloads, allreduce of summable ones, ...)
    validate        every received payload, before anything is written (gradcomp.validation)
    decode-average  sum of D(payload_r) for r = 0 .. P-1 in fp32, / P  (bitwise equal on every rank)
    commit          e <- residual_decay * e' only if the average is finite (on every rank: all decode the same bytes)

A dense step (warm-up, a group under ``min_numel``, a compressor whose payload is the
gradient itself) adds the residuals still held for the group into the gradient ("flush", so
nothing held back is lost) and averages with the framework's own allreduce; so does a compressor
that keeps no residual (a cast), into what it compresses.

Public API: ``Engine(compressor, transport, ...)`` (the arguments below), ``start(flat_grad, keys,
numels, group) -> Handle`` (compress and launch; never waits), ``finish(handle, result)`` (validate,
decode-average into ``flat_grad``, commit; never waits), ``end_step()``, ``stats()``,
``state_dict()``/``load_state_dict()``, ``check_agreement(groups)`` and ``exchange_for(compressor, numel,
dtype, device)`` (which exchange carries such a group). What adapters implement is
:class:`gradcomp.transport.Transport`; what an exchange implements, :class:`gradcomp.exchanges.Exchange`.

``start`` and ``finish`` do not block (on DDP ``finish`` runs inside the future's ``.then``; the finite
check that decides the commit stays a device tensor). The blocking calls are the settings check (at
set-up and DDP's bucket rebuild) and an exchange's own (the two-phase exchange's phase 1, in ``start``).

Extension slots (filled by :mod:`gradcomp.schedule` and :mod:`gradcomp.optim`):

* ``schedule``: ``compressor_at(step, base) -> Optional[Compressor]`` (``None``: dense; the
  result must be a function of ``step`` and ``base`` only, so that every rank agrees),
  ``state_dict()``, ``load_state_dict(d)`` (raises, changing nothing, if ``d`` does not fit).
  Default: :class:`gradcomp.schedule.DenseWarmup` of ``warmup_steps``.
* ``transform``: ``before_compress(keys, numels, g, compressor) -> g'``, ``after_compress(keys, payload,
  compressor, numel)``, ``dense(keys, numels, g) -> g'`` (all ``g`` float32 ``[n]``), optionally
  ``after_average(keys, numels, average, dense)`` (maps the group's average, in place, back to
  gradient units before the commit: ``.grad`` holds the average gradient) and ``commit(keys, accept)`` (state
  kept on an accepted step only), ``state_dict()``, ``load_state_dict(d)``, ``suspended`` (true: no commit),
  and ``divisor(keys, numels) -> d`` (float32 ``[n]`` or ``None``) where ``before_compress`` is ``g / d`` and
  ``after_average`` ``average * d``: then, for an exchange and compressor that both ``divide``, the compress
  divides as it loads and the average multiplies as it finishes, and neither call is made (two passes over the
  group fewer; bitwise the same).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from gradcomp import agreement, checkpoint, exchanges, settings
from gradcomp.agreement import AGREEMENT_FIELDS, SettingsMismatchError
from gradcomp.checkpoint import STATE_FORMAT
from gradcomp.compressors.base import FLOAT_DTYPES, Compressor
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchanges import Exchange, ExchangeContext, Handle
from gradcomp.settings import DEFAULT_MIN_NUMEL
from gradcomp.telemetry import Telemetry
from gradcomp.transport import Transport

__all__ = ["Engine", "Handle", "Transport", "SettingsMismatchError", "STATE_FORMAT", "AGREEMENT_FIELDS"]

logger = logging.getLogger(__name__)

#: How a group's parameters share a compressed payload (see :class:`Engine`).
GRANULARITIES = ("parameter", "bucket")


class Engine:
    """Runs every step of compressed data-parallel averaging; see the module docstring.

    Args:
        compressor: the base :class:`~gradcomp.Compressor`.
        transport: the integration's :class:`Transport` (may be set later, e.g. after unpickling).
        warmup_steps: dense steps before compression starts (the default schedule's length;
            not with ``schedule``). Default :data:`gradcomp.settings.DEFAULT_WARMUP_STEPS`.
        min_numel: groups with fewer elements go dense.
        error_feedback: keep residuals (only compressors with ``uses_error_feedback`` need them).
        residual_decay: in (0, 1]; ``e'`` is multiplied by it at commit (a rejected step changes nothing),
            so what was held back ``k`` steps ago counts ``residual_decay ** k`` (1: plain error feedback);
            for groups compressed with ``compressor``'s class (a policy's other choices: plain error feedback).
        backend: kernel backend override (``"torch"``, ``"numba"``, ``"cuda"``; else
            ``$GRADCOMP_BACKEND``, else automatic).
        schedule, transform: the extension slots of the module docstring.
        exchange: the name of the exchange that carries payloads that cannot be summed, one of
            ``gradcomp.exchanges.names(selectable=True)`` (default :data:`gradcomp.exchanges.DEFAULT`);
            groups it does not apply to go through the default one.
        granularity: ``"parameter"`` (default): top-k keeps ``ceil(density * n_i)`` entries of
            each parameter and a 2-bit scale is per parameter, parameters under ``min_numel``
            travel dense in the same payload (:mod:`gradcomp.compressors.per_parameter`);
            ``"bucket"``: the whole group is one tensor. An exchange that chunks the group
            (two-phase) ignores it.
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision run. Each group is divided
            by its scale on arrival and the average multiplied back before the framework sees it,
            so residuals, DGC velocities and second-stage residuals hold true-gradient units and
            need no rescaling when the scale grows or backs off (GradScaler's scales are powers of
            two, so both operations are exact).
    """

    def __init__(self, compressor: Compressor, transport: Optional[Transport] = None, *,
                 warmup_steps: Optional[int] = None, min_numel: int = DEFAULT_MIN_NUMEL, error_feedback: bool = True,
                 backend: Optional[str] = None, schedule=None, transform=None, exchange: str = exchanges.DEFAULT,
                 policy=None, granularity: str = "parameter", grad_scaler=None, residual_decay: float = 1.0):
        self.compressor = settings.check_compressor(compressor)
        self.grad_scaler = grad_scaler
        self._scale_at: Tuple[int, float] = (-1, 1.0)
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
        #: ``"parameter"``: each parameter of a group compressed on its own (:class:`PerParameter`);
        #: ``"bucket"``: the group as one tensor.
        self.granularity = granularity
        #: Optional per-group choice of compressor (:class:`gradcomp.policy.Auto`): asked in ``start``
        #: for each group on compressed steps, told in ``finish`` when the group's collective completed.
        self.policy = policy
        schedule, transform = settings.check_schedule(schedule, warmup_steps), settings.check_transform(transform)
        self.min_numel = settings.check_count("min_numel", min_numel)
        self.error_feedback = bool(error_feedback)
        self.residual_decay = settings.check_decay(residual_decay)
        self.backend = settings.check_backend_name(backend)
        self.schedule, self.transform = schedule, transform
        scatters = bool(getattr(transport, "scatters", False))  # FSDP's reduce-scatter: each rank gets a chunk
        self.exchange = exchanges.check_selectable(exchange, scatters)
        #: The exchanges tried for each group, in order (:func:`gradcomp.exchanges.chain`, fixed here by the
        #: transport); they hold their own state (the two-phase exchange's second-stage residuals).
        self.exchanges: Tuple[Exchange, ...] = exchanges.chain(exchange, scatters, granularity=granularity,
                                                               min_numel=self.min_numel)
        for held in self.exchanges:
            if transform is not None and held.no_transform_reason is not None:
                raise ValueError(f"exchange={held.name!r} takes no optimizer-aware transform "
                                 f"({held.no_transform_reason}); use exchange={exchanges.DEFAULT!r}")
        self.transport = transport
        self._chosen: Dict[tuple, tuple] = {}  # exchange_for's answers
        self._held_context: Optional[ExchangeContext] = None
        self.residual_memory = ErrorFeedback()
        self.telemetry = Telemetry()
        self._step_compressor: Tuple[int, Optional[Compressor]] = (-1, None)
        self._compression_logged = self._flush_logged = False
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
        self.telemetry.step = settings.check_count("step", value)

    @property
    def warmup_steps(self) -> Optional[int]:
        """The schedule's dense steps (``None`` for a schedule without that notion)."""
        return getattr(self.schedule, "dense_steps", None)

    def check_backend(self, device) -> str:
        """Resolve the kernel backend for ``device`` now (argument, ``$GRADCOMP_BACKEND`` or automatic):
        adapters call it at set-up, so a bad name or a missing dependency fails before any step."""
        return settings.check_backend(self.backend, device)

    def compressor_now(self) -> Optional[Compressor]:
        """The compressor of this step (``None``: a dense step), asked of the schedule once per step."""
        step, compressor = self._step_compressor
        if step != self.step:
            compressor = self.schedule.compressor_at(self.step, self.compressor)
            self._step_compressor = (self.step, compressor)
        return compressor

    def exchange_for(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device) -> Exchange:
        """The exchange that carries a group of ``numel`` elements of ``dtype`` compressed with
        ``compressor`` (``None``: a dense step); the same on every rank.

        The answer depends on nothing else, so it is kept per (compressor, size, dtype, device,
        transport) and the exchanges are asked once, not at every step."""
        if compressor is not None and (dtype not in FLOAT_DTYPES or numel < self.min_numel):
            compressor = None
        key = (id(compressor), numel, dtype, device, id(self.transport))
        held = self._chosen.get(key)
        if held is not None and held[0] is compressor and held[1] is self.transport:  # not a reused id
            return held[2]
        exchange = next((e for e in self.exchanges if e.applies(compressor, numel, dtype, device, self.transport)),
                        None)
        if exchange is None:
            raise RuntimeError(f"no exchange of {[e.name for e in self.exchanges]} takes a group of {numel} {dtype}")
        if len(self._chosen) >= 256:  # a schedule hands out a few compressors; bounded anyway
            self._chosen.clear()
        self._chosen[key] = (compressor, self.transport, exchange)
        return exchange

    # -- one group's exchange ----------------------------------------------------------
    def start(self, grad: torch.Tensor, keys: Sequence[Hashable], numels: Sequence[int], group: Hashable) -> Handle:
        """Compress ``grad`` and launch its collective; returns the :class:`Handle`.

        Args:
            grad: the group's flat contiguous gradient ``[n]`` (float32/16/bf16). It is
                mutated on dense steps (residuals added, scaled by the allreduce) and receives
                the average in :meth:`finish`; on compressed steps it is only read here, but for
                the residuals flushed into it when the compressor keeps none.
            keys: the names of the parameters laid out in ``grad``, in order.
            numels: their element counts (sum ``n``).
            group: a name for telemetry and error messages (DDP: the bucket index).
        """
        keys, numels = tuple(keys), tuple(map(int, numels))
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
        exchange = self.exchange_for(compressor, grad.numel(), grad.dtype, grad.device)
        handle = Handle(group, keys, numels, grad, exchange, exchange.granular(compressor, numels))
        handle.scale, handle.started = scale, time.perf_counter()
        context, source = self._context(), self._transformed(handle)
        exchange.compress(context, handle, source, self._compensate(handle, source))
        if self.transform is not None and not exchange.sends_gradient:
            self.transform.after_compress(keys, handle.payload, handle.compressor, grad.numel())
        exchange.start(context, handle)
        return handle

    def finish(self, handle: Handle, result: torch.Tensor) -> torch.Tensor:
        """Write the average of ``handle``'s group into its gradient and return the gradient.

        The average is in the loss scale the gradient arrived in (see ``grad_scaler``).

        ``result`` is the collective's output: the reduced tensor (dense, summable payloads) or the
        gathered payloads (any integer view of the gathered bytes). Received payloads are validated
        before anything is written; a bad one raises :class:`~gradcomp.validation.PayloadError`
        naming the sender and the group, and leaves the gradient and the residuals as they were.
        Never blocks.
        """
        if self.policy is not None:
            self.policy.finished(handle)
        context = self._context()
        average = handle.exchange.finish(context, handle, result)
        self._commit(context, handle, average)  # on what the model receives: a float16 overflow rejects the step
        if handle.scale != 1.0:
            average.mul_(handle.scale)
        return average

    def _context(self) -> ExchangeContext:
        """The narrow view of this engine that an exchange gets (kept until the transport, which may be set late,
        or the backend changes)."""
        held = self._held_context
        if held is None or held.transport is not self.transport or held.backend != self.backend:
            held = self._held_context = ExchangeContext(self.transport, self.backend, self.telemetry.record)
        return held

    def _compensate(self, handle: Handle, source: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """The group's residual buffers ``(e, e')`` for a compressor that keeps residuals; otherwise
        what the residuals still hold is added into ``source`` (mutated) and sent now, as a dense step
        does (a policy may move a group from top-k to fp16), and ``None`` is returned."""
        compressor = handle.compressor
        if not handle.exchange.sends_gradient and compressor.uses_error_feedback:
            if not self.error_feedback:
                return None
            return self.residual_memory.buffers(handle.keys, handle.numels, handle.grad.device)
        self._flush_residuals(handle.keys, handle.numels, source)
        return None

    def _flush_residuals(self, keys, numels, grad: torch.Tensor) -> None:
        """Send what the residuals hold with this step's ``grad`` (see :meth:`ErrorFeedback.flush_into`)."""
        flushed = self.residual_memory.flush_into(keys, numels, grad)
        if flushed and not self._flush_logged:
            self._flush_logged = True
            logger.info("gradcomp: residuals of %d parameters flushed into a dense step at step %d (first: %r)",
                        len(flushed), self.step, flushed[0])

    # -- the transform slot (its after_compress call is in start) ------------------------
    def _transformed(self, handle: Handle) -> torch.Tensor:
        """What the exchange sends or compresses: the gradient, or the transform's output. On a dense
        step the transform sees the gradient alone and the residual is added after it, in the order of a
        compressed step (acc = transform(g) + e): a DGC residual already holds velocity, and must not
        pass through the momentum a second time."""
        grad = handle.grad
        if handle.exchange.sends_gradient:
            sent = grad if self.transform is None else self.transform.dense(handle.keys, handle.numels, grad.float())
            if sent is not grad:  # a suspended stage sends the gradient itself: no copy
                grad.copy_(sent)
            return grad
        if not self._compression_logged:
            self._compression_logged = True
            logger.info("gradcomp: compression starts at step %d with %r", self.step, handle.compressor)
        if self.transform is None:
            return grad
        handle.divisor = self._divisor(handle)
        if handle.divisor is not None:  # the kernels divide as they load: no divided copy of the gradient
            return grad
        return self.transform.before_compress(handle.keys, handle.numels, grad.float(), handle.compressor)

    def _divisor(self, handle: Handle) -> Optional[torch.Tensor]:
        """The transform's ``divisor(keys, numels)`` (float32 ``[n]``, or ``None``), where it stands for its
        ``before_compress`` and ``after_average`` and the exchange and the compressor can apply it (both
        ``divides``): a float32 gradient whose residuals stay in the compressor's memory."""
        divisor = getattr(self.transform, "divisor", None)
        compressor = handle.compressor
        if (divisor is None or not handle.exchange.divides or not compressor.divides
                or not compressor.uses_error_feedback or handle.grad.dtype != torch.float32):
            return None
        return divisor(handle.keys, handle.numels)

    def _commit(self, context: ExchangeContext, handle: Handle, average: torch.Tensor) -> None:
        """Commit ``e'`` (and the state of an exchange or transform that keeps some) only if the exchange accepts
        the step (``average`` finite on every rank); a device-tensor decision is read at the next use.

        ``average`` is what the group's gradient received, in the gradient's dtype (every exchange returns
        the gradient itself after the write), so a result finite in float32 that overflows in float16 commits nothing.

        First the transform maps the average back to gradient units in place (``after_average``),
        so that what the framework writes into ``.grad`` is the average gradient whatever the
        stage exchanged."""
        exchange = handle.exchange
        after = getattr(self.transform, "after_average", None)
        if after is not None and handle.divisor is None:  # with a divisor the exchange multiplied it back
            after(handle.keys, handle.numels, average, exchange.sends_gradient)
            handle.finite = None  # learnt before the product
        feedback = not exchange.sends_gradient and handle.compressor.uses_error_feedback and self.error_feedback
        commit = getattr(self.transform, "commit", None)  # a stage whose state waits on the step's verdict
        if not feedback and (commit is None or getattr(self.transform, "suspended", False)):
            return  # nothing to commit: no finite check
        accept = exchange.accept(context, handle, average)
        if feedback:
            own = type(handle.compressor.unwrapped()) is type(self.compressor)  # the decay's kind, per part too
            self.residual_memory.commit(handle.keys, accept, self.residual_decay if own else 1.0)
            if exchange.state_key is not None:
                exchange.commit(context, handle, accept)
        if commit is not None:
            commit(handle.keys, accept)

    def _loss_scale(self) -> float:
        """The grad scaler's scale this step (read once per step; 1.0 without a scaler)."""
        if self._scale_at[0] != self.step:
            self._scale_at = (self.step, settings.loss_scale(self.grad_scaler))
        return self._scale_at[1]

    def end_step(self) -> None:
        """Close the step: telemetry moves on and the schedule sees the next step number."""
        self.telemetry.end_step()
        self._steps_run += 1

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
        """Validate :meth:`state_dict`'s output; return what assigns it (:func:`gradcomp.checkpoint.prepare_load`)."""
        return checkpoint.prepare_load(self, state_dict, parameter_numels, unknown_residuals)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["transport"] = None  # process groups and Horovod handles do not cross processes
        state["_chosen"], state["_held_context"] = {}, None  # they hold the transport too
        return state

