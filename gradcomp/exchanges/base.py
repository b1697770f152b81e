"""The interface every exchange implements, and the narrow context it is given instead of the engine.

An exchange moves one group's compressed gradient between the ranks and leaves the average in
the group's gradient. The engine keeps the step around it (schedule, policy, transform,
compensate, commit) and, per group, asks its chain of exchanges (:func:`registry.chain`) which
one :meth:`Exchange.applies`; then, for that one::

    compress(context, handle, source, residuals)   payload(s) of the group; may block (two-phase's phase 1)
    -- the engine's transform sees handle.payload here (after_compress) --
    start(context, handle)                         record telemetry, launch the collective -> handle.work
    -- the adapter awaits handle.work and hands its tensor back --
    finish(context, handle, result)                validate, decode-average into handle.grad; never blocks
    -- the engine decides the commit from what finish returned --
    accept(context, handle, average)               whether the step commits (default: average is finite)
    commit(context, handle, accept)                the exchange's own state (two-phase's second stage)

An exchange never sees the engine: :class:`ExchangeContext` carries the transport, the kernel
backend and the telemetry's ``record``, and the engine calls :meth:`Exchange.commit` itself. The
shape follows FSDP2's collective interfaces (``torch.distributed.fsdp``: one small class per
collective, chosen by the framework, never asked which implementation it holds).

Scattering exchanges (:attr:`Exchange.scatters`, :mod:`gradcomp.exchanges.reduce_scatter`) fit the
same calls: ``handle.grad`` is the whole flat input of FSDP's reduce-scatter (``P`` equal chunks,
chunk ``j`` for rank ``j``), and ``finish`` writes this rank's chunk of the average into this rank's
chunk of ``handle.grad`` and returns that chunk, which the adapter hands to FSDP. An engine whose
transport scatters (:attr:`gradcomp.transport.Transport.scatters`) tries only scattering exchanges,
and no other engine tries them. Each rank then sees only its own chunk of the average, so such an
exchange decides the commit for every rank alike in :meth:`Exchange.accept`.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, ClassVar, Hashable, NamedTuple, Optional, Sequence, Tuple

import torch

from gradcomp.backends import form_kernel
from gradcomp.compressors.base import Compressor
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import all_finite

if TYPE_CHECKING:  # annotations only: the engine and gradcomp.transport import this package
    from gradcomp.costmodel import Cluster, Cost, Kernels
    from gradcomp.transport import Transport

__all__ = ["Exchange", "ExchangeContext", "Handle", "compress_group", "average_gathered", "average_finite",
           "payload_is_gradient"]


class ExchangeContext(NamedTuple):
    """What an exchange is given of the engine, and nothing more.

    Attributes:
        transport: the integration's :class:`gradcomp.transport.Transport` (``world_size``,
            ``rank``, the collectives).
        backend: the kernel backend override (``None``: automatic).
        record: ``record(group, bytes_sent, dense_bytes, compress_s, mode, backend=None)``, the
            telemetry of :class:`gradcomp.telemetry.Telemetry`.
    """

    transport: "Transport"
    backend: Optional[str]
    record: Callable[..., None]


class Handle:
    """One group's exchange in flight, from :meth:`gradcomp.engine.Engine.start` to its ``finish``: filled by the
    engine and the group's exchange, opaque to adapters but for ``work`` (what the transport returned)
    and ``exchange`` (which exchange carries the group)."""

    __slots__ = ("group", "keys", "numels", "grad", "exchange", "compressor", "payload", "wire", "work", "scale",
                 "started", "compress_s", "divisor", "finite")

    def __init__(self, group, keys, numels, grad, exchange, compressor=None):
        self.group: Hashable = group
        self.keys: Tuple[Hashable, ...] = keys
        self.numels: Tuple[int, ...] = numels
        self.grad: torch.Tensor = grad  # the flat gradient; receives the average
        self.exchange = exchange  # the gradcomp.exchanges.Exchange that carries the group
        self.compressor: Optional[Compressor] = compressor  # None or the schedule's on a dense step
        self.payload: Optional[Payload] = None  # what the exchange compressed (a transform reads it)
        self.wire: Optional[torch.Tensor] = None  # the tensor handed to the collective
        self.work = None  # the transport's work object (a Future on DDP, a Horovod handle)
        self.scale = 1.0  # the loss scale the gradient arrived in (see Engine(grad_scaler=))
        self.started = 0.0  # time.perf_counter() when the engine began the group's step
        self.compress_s: Optional[float] = None  # compression seconds, where the exchange measures them
        #: float32 ``[n]``: the payload compresses ``grad / divisor`` (a stage's units, divided as the kernel loads)
        #: and the average is multiplied back by it (:attr:`Exchange.divides`); ``None``: neither.
        self.divisor: Optional[torch.Tensor] = None
        #: Whether the average ``finish`` wrote is finite, where the exchange learnt it as it wrote (``None``: not
        #: known; :meth:`Exchange.accept` then reads the average). Whoever changes the average after clears it.
        self.finite: Optional[bool] = None

    @property
    def mode(self) -> str:  # the exchange's registered name, as stats() reports it
        return self.exchange.name


class Exchange(abc.ABC):
    """One way a group's gradient travels between the ranks (abstract base class).

    Subclasses are registered by name (:func:`gradcomp.exchanges.registry.exchange_name`) and
    describe themselves with the class attributes below. An instance lives as long as its
    engine; it is built with the engine's ``granularity`` and ``min_numel`` and may keep state
    across steps (then it names its checkpoint key, :attr:`state_key`).
    """

    #: The registered name: ``Engine(exchange=...)``, the ``"mode"`` of ``stats()``, the cost model.
    name: ClassVar[str] = ""
    #: How tables and plots name it ("two-phase").
    label: ClassVar[str] = ""
    #: Tried for every group before the engine's chosen exchange (a dense step, a summable
    #: payload); automatic exchanges must not apply to the same group.
    automatic: ClassVar[bool] = False
    #: ``Engine(exchange=name)`` may choose it for payloads that cannot be summed.
    selectable: ClassVar[bool] = False
    #: The engine can run it (``False``: only modelled, or run by an adapter itself).
    runnable: ClassVar[bool] = True
    #: :meth:`cost` models it (:func:`gradcomp.costmodel.predict`).
    modelled: ClassVar[bool] = True
    #: It allreduces the gradient itself (no payload, no residual of this step): the engine flushes
    #: held residuals into the gradient and hands a transform its ``dense`` call.
    sends_gradient: ClassVar[bool] = False
    #: ``finish`` returns the average whatever the transport's reduction op (a framework asked for
    #: a sum multiplies it back); ``False``: the transport's ``allreduce_average`` reduces.
    averages_itself: ClassVar[bool] = True
    #: Why an optimizer-aware transform cannot run with it (``None``: it can).
    no_transform_reason: ClassVar[Optional[str]] = None
    #: The checkpoint key of :meth:`state_dict` (``None``: it keeps no state, and :meth:`commit` is not
    #: called), and what that state is.
    state_key: ClassVar[Optional[str]] = None
    state_what: ClassVar[str] = ""
    #: The cost model lays its ranks out in nodes (dense inside, compressed between).
    node_aware: ClassVar[bool] = False
    #: ``finish`` leaves only this rank's chunk of the average (FSDP's reduce-scatter; see the module
    #: docstring): only an engine whose transport scatters tries it, and such an engine tries nothing else.
    scatters: ClassVar[bool] = False
    #: :meth:`compress` and :meth:`finish` apply :attr:`Handle.divisor` (the engine sets one only then, for a
    #: compressor that :attr:`~gradcomp.compressors.base.Compressor.divides`): the payload is of the gradient
    #: divided by it, the average is multiplied back by it.
    divides: ClassVar[bool] = False

    def __init__(self, granularity: str = "parameter", min_numel: int = 0):
        self.granularity, self.min_numel = granularity, min_numel

    # -- the step ----------------------------------------------------------------------
    @abc.abstractmethod
    def applies(self, compressor: Optional[Compressor], numel: int, dtype: torch.dtype, device,
                transport: Optional["Transport"]) -> bool:
        """Whether this exchange takes a group of ``numel`` elements of ``dtype`` on ``device``.

        ``compressor`` is ``None`` on a dense step (the schedule's warm-up, a group under
        ``min_numel``, a dtype that is not compressed). The answer must be the same on every rank.
        """

    def granular(self, compressor: Optional[Compressor], numels: Tuple[int, ...]) -> Optional[Compressor]:
        """The compressor this exchange applies to a group of parameters of ``numels`` (``handle.compressor`` from
        the step's start, so that a transform sees it): ``compressor`` over the whole group by default; an exchange
        that compresses each parameter on its own returns the per-parameter wrapper, which says which parameters
        travel whole."""
        return compressor

    def compress(self, context: ExchangeContext, handle: Handle, source: torch.Tensor,
                 residuals: Optional[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Make the group's payload: by default ``handle.compressor`` over the whole group.

        Args:
            source: what to compress, float32/16/bf16 ``[n]`` (the gradient, or a transform's
                output); read only.
            residuals: ``(residual_in, residual_out)`` float32 ``[n]`` of the error feedback
                (``residual_out`` receives ``e'``, committed later by the engine), or ``None``.
        Sets ``handle.payload`` and ``handle.wire`` (the tensor :meth:`start` hands over).
        """
        handle.payload = compress_group(handle.compressor, source, residuals, context.backend, handle.divisor)
        handle.wire = handle.payload.buffer

    @abc.abstractmethod
    def start(self, context: ExchangeContext, handle: Handle) -> None:
        """Record the group in the telemetry and launch its collective (``handle.work``); never waits."""

    @abc.abstractmethod
    def finish(self, context: ExchangeContext, handle: Handle, result: torch.Tensor) -> torch.Tensor:
        """Validate ``result`` (the collective's output), write the average into ``handle.grad`` and
        return what received it, in the gradient's dtype. Raises
        :class:`~gradcomp.validation.PayloadError` naming the sender before anything is written."""

    def accept(self, context: ExchangeContext, handle: Handle, average: torch.Tensor):
        """Whether the step of ``handle``'s group commits its residuals (a bool or a 0-d device tensor,
        the same on every rank): by default whether ``average`` (what :meth:`finish` returned, in the
        gradient's dtype) is finite, which every rank decides alike because it decoded the same bytes.
        Called by the engine after :meth:`finish`, for groups that keep residuals or run a transform."""
        return handle.finite if handle.finite is not None else all_finite(average)

    def commit(self, context: ExchangeContext, handle: Handle, accept) -> None:
        """Commit this exchange's own state of the step if ``accept`` (a bool or a 0-d device tensor,
        decided by the engine from :meth:`finish`'s result); called for an exchange that keeps state
        (:attr:`state_key`), when the group kept residuals."""

    # -- the cost model ------------------------------------------------------------------
    @classmethod
    def cost(cls, compressor: Optional[Compressor], numel: int, cluster: "Cluster", kernels: "Kernels",
             dtype: torch.dtype = torch.float32) -> "Cost":
        """Per-rank bytes and seconds of one group of ``numel`` elements (:mod:`gradcomp.costmodel`)."""
        raise ValueError(f"exchange {cls.name!r} has no cost model")

    # -- settings and checkpoints ------------------------------------------------------
    def settings(self) -> object:
        """Plain values every rank must share beyond the exchange's name (``None``: none)."""
        return None

    def state_dict(self) -> dict:
        """This rank's state of the exchange (saved under :attr:`state_key`)."""
        return {}

    def prepare_load(self, saved, world_size: int, rank: int) -> Callable[[], None]:
        """Validate ``saved`` (a :meth:`state_dict` of the rank ``rank`` of ``world_size``) and return
        the function that assigns it; raises ``ValueError`` and changes nothing when it does not fit."""
        return lambda: None

    def reset(self) -> None:
        """Forget the state (a checkpoint of another world size, rank or compressor was loaded)."""


def compress_group(compressor: Compressor, source: torch.Tensor,
                   residuals: Optional[Tuple[torch.Tensor, torch.Tensor]], backend: Optional[str],
                   divisor: Optional[torch.Tensor] = None) -> Payload:
    """``compressor``'s payload of ``source`` (``[n]``, read only), fusing the error feedback when
    ``residuals`` (``(residual_in, residual_out)``, float32 ``[n]``; ``residual_out`` written) are given, and the
    division by ``divisor`` (float32 ``[n]``; only for a compressor that ``divides``) when it is."""
    extra = {} if divisor is None else {"divisor": divisor}
    if residuals is None:
        return compressor.compress(source, backend=backend, **extra)
    return compressor.compress(source, residuals[0], residuals[1], backend=backend, **extra)


def payload_is_gradient(compressor: Compressor, numel: int, dtype: torch.dtype) -> bool:
    """Whether ``compressor``'s payload of a ``[numel]`` ``dtype`` gradient is that gradient itself
    (``Identity``, a cast to the gradient's own dtype): then the framework's own allreduce sends it."""
    return compressor.summable and compressor.layout(numel, dtype) == PayloadLayout((("data", dtype, numel),))


def average_gathered(compressor: Compressor, layout: PayloadLayout, gathered: torch.Tensor, out: torch.Tensor,
                     backend: Optional[str] = None, checked: Sequence = (),
                     multiplier: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = (D(p_0) + D(p_1) + ... + D(p_{P-1})) / P``, summed in rank order in float32, so that
    every rank decoding the same bytes gets bitwise the same average; with ``multiplier`` (float32 ``[n]``, the
    divisor the payloads were compressed under, :attr:`Handle.divisor`) that average times it, in one pass where
    the backend has one (``divide_multiply``). A compressor that :attr:`~Compressor.averages` writes it all in one
    call, each element once, in the same float32 operations and order (bitwise alike).

    Args:
        gathered: uint8 ``[P * layout.nbytes]``, rank ``r``'s payload at ``r * layout.nbytes``
            (validated by the caller).
        out: float32 ``[n]``, overwritten and returned.
        checked: per rank, what the validation's check returned (:func:`~gradcomp.validation.validate_gathered`):
            where not ``None`` the compressor adds it (``add_checked``) instead of decoding the bytes again.
    """
    average_finite(compressor, layout, gathered, out, backend, checked, multiplier)
    return out


def average_finite(compressor: Compressor, layout: PayloadLayout, gathered: torch.Tensor, out: torch.Tensor,
                   backend: Optional[str] = None, checked: Sequence = (),
                   multiplier: Optional[torch.Tensor] = None) -> Optional[bool]:
    """:func:`average_gathered`; returns whether ``out`` is finite where the compressor's one-call average
    (:attr:`Compressor.averages`) learnt it as it wrote, else ``None``."""
    world_size = gathered.numel() // layout.nbytes
    if compressor.averages and all(done is None for done in checked):
        return compressor.average(layout, gathered, out, backend, multiplier)
    out.zero_()
    for rank in range(world_size):
        payload = Payload(layout, gathered[rank * layout.nbytes: (rank + 1) * layout.nbytes])
        done = checked[rank] if rank < len(checked) else None
        if done is None:
            compressor.decompress_add(payload, out, backend)
        else:
            compressor.add_checked(payload, done, out, backend)
    if multiplier is None:
        out.div_(world_size)
        return None
    fused = form_kernel("elementwise", "divide_multiply", out.device, backend)
    if fused is None:
        out.div_(world_size).mul_(multiplier)
    else:
        fused(out, world_size, multiplier)
    return None
