"""DDP communication hook: a thin adapter from DDP's buckets to :class:`gradcomp.engine.Engine`.

The engine does every step (schedule, error feedback, compression, validation of received
payloads, the rank-ordered average, the transactional residual commit); this module only
translates a :class:`torch.distributed.GradBucket` into ``engine.start`` / ``engine.finish``
and launches the collectives with ``torch.distributed``.

Example::

    >>> import gradcomp
    >>> from gradcomp.hooks import ddp as gc_ddp
    >>> model = torch.nn.parallel.DistributedDataParallel(net)
    >>> state = gc_ddp.register(model, gradcomp.TopK(0.01))
    >>> # ... train as usual; state.stats() reports bytes and timings,
    >>> # state.state_dict() goes into the checkpoint beside the optimizer's.
"""
# No `from __future__ import annotations`: DDP checks the hook's annotations at
# registration and needs them to be the real dist.GradBucket / Future[Tensor].
import logging
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradcomp import inflight
from gradcomp.compressors.base import Compressor
from gradcomp.engine import Engine, Transport
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchanges import DEFAULT as DEFAULT_EXCHANGE
from gradcomp.exchanges.sparse import FrameworkSparse
from gradcomp.hooks import direct
from gradcomp.settings import DEFAULT_MIN_NUMEL
from gradcomp.setup import prepare, speaks_to_caller

__all__ = ["CompressionState", "compression_hook", "register"]

logger = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; accept both.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchDistributedTransport(Transport):
    """Collectives over a ``torch.distributed`` process group (``None``: the default group)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        self.process_group = process_group
        self._size_of: Tuple[object, int] = (None, 1)  # (group, its size): asked at every exchange

    @property
    def _group(self):
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        if not dist.is_initialized():
            return 1
        group = self._group
        if self._size_of[0] is not group:  # a group's size never changes; a new default group is another object
            self._size_of = (group, dist.get_world_size(group))
        return self._size_of[1]

    @property
    def rank(self) -> int:
        return dist.get_rank(self._group) if dist.is_initialized() else 0

    def allreduce_average(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        # Scaling before the sum keeps fp16 from overflowing; multiplying by 1/P (not
        # dividing by P) is what DDP's built-in reducer does, so a dense step is bitwise
        # equal to DDP without a hook.
        tensor.mul_(1.0 / self.world_size)
        (handed,) = inflight.hold(tensor)  # Gloo's thread must not be its last owner at exit (see gradcomp.inflight)
        return dist.all_reduce(handed, group=self._group, async_op=True).get_future()

    def allreduce_sum(self, tensor: torch.Tensor, name: str) -> torch.futures.Future:
        (handed,) = inflight.hold(tensor)
        return dist.all_reduce(handed, group=self._group, async_op=True).get_future()

    def allgather(self, buffer: torch.Tensor, name: str) -> torch.futures.Future:
        """Start an allgather of the 1-D uint8 ``buffer`` (the same size on every rank); the future's
        value is ``[gathered]``, uint8 ``[world_size * buffer.numel()]``. On Gloo every receive is posted
        before any send (:mod:`gradcomp.hooks.direct`: a late rank's own payload no longer holds up its receive)."""
        if direct.applies(self._group, self.world_size, buffer):
            return direct.gather(buffer, self._group, self.rank, self.world_size, name)
        gathered = torch.empty(self.world_size * buffer.numel(), dtype=torch.uint8, device=buffer.device)
        # Aliases held until Gloo's thread lets go of them, so it never needs the GIL at exit (see inflight).
        sent, received = inflight.hold(buffer, gathered)
        work = _all_gather_flat(received, sent, group=self._group, async_op=True)

        # The work's own future does not carry the output tensor on every backend (Gloo gives back
        # views of it), so hand on the buffer gathered into -- after value() has re-raised any failure.
        def gathered_or_raise(fut: torch.futures.Future):
            # value() made Python objects of the work's views; Gloo's thread must not free them (inflight.keep).
            inflight.keep(fut.value())
            return [gathered]

        return work.get_future().then(inflight.watch(gathered_or_raise))

    def all_to_all(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        received = torch.empty_like(buffer)
        # Blocking, but Gloo's thread still destroys the work after wait(): hand it held aliases.
        outgoing, incoming = inflight.hold(buffer, received)
        dist.all_to_all_single(incoming, outgoing, group=self._group)  # Gloo (CPU) and NCCL have it
        return received

    def agree(self, fingerprint: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(fingerprint) for _ in range(self.world_size)]
        sent, *received = inflight.hold(fingerprint, *parts)
        dist.all_gather(received, sent, group=self._group)
        return torch.stack(parts)


class CompressionState:
    """State of :func:`compression_hook`: the engine (settings, residuals, step, telemetry) and
    the parameter names. The settings are read where they live, on the engine
    (``state.engine.compressor``, ``state.engine.exchange``, ...).

    Args:
        compressor: a :class:`gradcomp.Compressor` (``TopK``, ``TwoBit``, ``FP16``, ...).
        process_group: the group to exchange over; ``None`` is the default group.
        warmup_steps: dense steps before compression starts (default 2, see
            :mod:`gradcomp.settings`); not with ``schedule``.
        min_numel: buckets with fewer elements go dense (default 1024).
        error_feedback: keep residuals (only for compressors that drop information).
        named_parameters: ``model.named_parameters()`` of the wrapped module; gives the
            residuals names that survive a restart. :func:`register` passes it.
        backend: kernel backend override (``"torch"``, ``"numba"``, ``"cuda"``).
        schedule, transform: the engine's extension slots (:mod:`gradcomp.engine`).
        exchange: the exchange that carries payloads that cannot be summed, by name
            (``gradcomp.exchanges.names(selectable=True)``; default :data:`gradcomp.exchanges.DEFAULT`).
        policy: a per-bucket choice of method, e.g. :class:`gradcomp.Auto` (measures the link
            during the dense warm-up, then picks dense, fp16, 2-bit or top-k per bucket).
        granularity: ``"parameter"`` (default: each parameter of a bucket compressed on its own,
            its own top-k budget and 2-bit scale) or ``"bucket"`` (the bucket as one tensor).
        grad_scaler: the run's ``torch.amp.GradScaler``, if it uses one: residuals are then kept in
            true-gradient units and survive its scale changes.
        residual_decay: each committed residual times it (default 1: plain error feedback; see
            :class:`gradcomp.engine.Engine`).
    """

    __slots__ = ["engine", "process_group", "recipe", "_param_names", "_parameter_numels", "_layouts"]

    def __init__(
        self,
        compressor: Compressor,
        process_group: Optional[dist.ProcessGroup] = None,
        warmup_steps: Optional[int] = None,
        min_numel: int = DEFAULT_MIN_NUMEL,
        error_feedback: bool = True,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        backend: Optional[str] = None,
        schedule=None,
        transform=None,
        exchange: str = DEFAULT_EXCHANGE,
        policy=None,
        granularity: str = "parameter",
        grad_scaler=None,
        residual_decay: float = 1.0,
    ):
        self.process_group = process_group
        #: What the one-call recipe chose (:class:`gradcomp.recipe.Plan`), or ``None``.
        self.recipe = None
        self.engine = Engine(compressor, TorchDistributedTransport(process_group), warmup_steps=warmup_steps,
                             min_numel=min_numel, error_feedback=error_feedback, backend=backend,
                             schedule=schedule, transform=transform, exchange=exchange,
                             policy=policy, granularity=granularity, grad_scaler=grad_scaler,
                             residual_decay=residual_decay)  # fmt: skip
        self._param_names: Optional[Dict[int, str]] = None
        self._parameter_numels: Optional[Dict[str, int]] = None
        self._layouts: Dict[int, tuple] = {}  # bucket index -> (its buffer, keys, numels): see layout()
        if named_parameters is not None:
            self.attach(named_parameters)

    def attach(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]) -> None:
        """Name the parameters, so residuals are saved and restored by name. Raises if residuals
        already held (e.g. loaded) belong to no parameter of this model."""
        named = list(named_parameters)
        names = {name for name, _ in named}
        unknown = [key for key in self.engine.residual_memory.keys() if isinstance(key, str) and key not in names]
        if unknown:
            raise ValueError(f"residuals are held for {unknown[:5]}, which are no parameters of this model")
        self._param_names = {id(param): name for name, param in named}
        self._parameter_numels = {name: param.numel() for name, param in named}
        self._layouts = {}

    @property
    def step(self) -> int:
        return self.engine.step

    @step.setter
    def step(self, value: int) -> None:
        self.engine.step = value

    @property
    def residual_memory(self) -> ErrorFeedback:
        """This rank's error-feedback memory (residuals keyed by parameter name)."""
        return self.engine.residual_memory

    # -- pickling: drop what cannot cross a process boundary, as PowerSGDState does ----
    def __getstate__(self):
        return {"engine": self.engine}

    def __setstate__(self, state):
        self.process_group = None
        self.recipe = None
        self._param_names = self._parameter_numels = None
        self._layouts = {}
        self.engine = state["engine"]
        self.engine.transport = TorchDistributedTransport(None)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's state in the engine's format (:meth:`gradcomp.engine.Engine.state_dict`),
        the same as the Horovod optimizer's. Save one per rank beside the model and optimizer;
        it loads with ``torch.load(..., weights_only=True)``."""
        if self._param_names is None and self.engine.residual_memory.keys():
            raise RuntimeError(
                "residuals are keyed by parameter identity because no names were given; "
                "create the state with gradcomp.hooks.ddp.register(model, ...) or "
                "CompressionState(..., named_parameters=model.module.named_parameters())"
            )
        return self.engine.state_dict()

    def full_state_dict(self) -> dict:
        """Every rank's :meth:`state_dict` in one dict (:func:`gradcomp.checkpoint.all_ranks`), for a
        loop that saves one file from rank 0. A collective: every rank calls it, every rank gets it.
        :meth:`load_state_dict` takes it on every rank, each taking its own part::

            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "gradcomp": state.full_state_dict()}
            if rank == 0:
                torch.save(ckpt, "ckpt.pt")
        """
        from gradcomp.checkpoint import all_ranks

        # Held gather: the script usually saves and ends right after it (see gradcomp.inflight).
        return all_ranks(inflight.all_gather_object(self.state_dict(), group=self.engine.transport.process_group))

    def load_state_dict(self, state_dict: dict, unknown_residuals: str = "raise") -> None:
        """Restore :meth:`state_dict` or this rank's part of :meth:`full_state_dict` (from DDP or the
        Horovod optimizer) transactionally; see :meth:`gradcomp.engine.Engine.load_state_dict`. A
        checkpoint of another world size, rank or compressor loads with a warning and zero residuals."""
        self.engine.load_state_dict(state_dict, self._parameter_numels, unknown_residuals)

    # -- telemetry ---------------------------------------------------------------------
    def stats(self) -> dict:
        """See :meth:`gradcomp.telemetry.Telemetry.stats` (groups are bucket indices)."""
        return self.engine.stats()

    # -- helpers for the hook ------------------------------------------------------------
    def layout(self, bucket: dist.GradBucket) -> Tuple[List, List[int]]:
        """The names and element counts of the parameters laid out in ``bucket``'s buffer.

        Asked of DDP once per bucket: listing a bucket's gradients and parameters makes a Python
        object per tensor at every call (about 0.1 ms of thread CPU a bucket inside the hook, beside
        other jobs). A bucket keeps its parameters as long as it keeps its buffer, and DDP's rebuild
        makes new buckets with new buffers; the entry holds the buffer, so a new one is never the old
        one's object or address."""
        buffer, index = bucket.buffer(), bucket.index()
        held = self._layouts.get(index)
        if held is None or held[0] is not buffer:  # the first step, or DDP rebuilt its buckets
            held = self._layouts[index] = (buffer, self._keys(bucket), [g.numel() for g in bucket.gradients()])
            if bucket.is_last():  # fewer buckets after a rebuild: let go of the old ones' buffers
                for stale in [i for i in self._layouts if i > index]:
                    del self._layouts[stale]
        return held[1], held[2]

    def _keys(self, bucket: dist.GradBucket) -> List:
        params = bucket.parameters()
        if self._param_names is None:
            return [("id", id(p)) for p in params]
        try:
            return [self._param_names[id(p)] for p in params]
        except KeyError:
            raise RuntimeError(
                "a bucket holds a parameter that was not in named_parameters; pass the "
                "named_parameters() of the module that DDP wraps (model.module)"
            ) from None


def _collective_result(fut: torch.futures.Future, bucket: dist.GradBucket) -> torch.Tensor:
    """The collective's output, or an error that says what failed and the likely cause."""
    try:
        return fut.value()[0]
    except Exception as error:
        raise RuntimeError(
            f"gradcomp: the exchange of gradient bucket {bucket.index()} failed: {error}. "
            "A peer rank probably died or timed out; see the other ranks' logs. Residuals "
            "were left as they were before this step."
        ) from error


def compression_hook(state: "CompressionState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses ``bucket`` with ``state.engine.compressor``.

    1. ``engine.start``: the schedule picks dense or compressed; a compressed bucket is
       compensated and compressed in one fused kernel (residuals per parameter name) and its
       fixed-size payload allgathered (summable payloads: one allreduce);
    2. in one ``.then`` (nothing waits): ``engine.finish`` validates every rank's payload,
       decodes them in rank order, sums in float32, divides by the world size and writes the
       result into ``bucket.buffer()``; the residual update is committed only if it is finite.

    Example::
        >>> state = CompressionState(gradcomp.TwoBit(0.5), named_parameters=net.named_parameters())
        >>> ddp_model.register_comm_hook(state, compression_hook)
    """
    engine: Engine = state.engine
    try:
        if bucket.buffer().is_sparse:
            return _sparse_average(engine, bucket)
        keys, numels = state.layout(bucket)
        handle = engine.start(bucket.buffer(), keys, numels, bucket.index())
    finally:
        if bucket.is_last():
            engine.end_step()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        return engine.finish(handle, _collective_result(fut, bucket))

    return handle.work.then(inflight.watch(finish))


def _sparse_average(engine: Engine, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The average of a sparse gradient's bucket (an embedding's with ``sparse=True``, which DDP buckets alone), by
    the framework's sparse allreduce, as DDP without a hook: uncompressed, no residual; recorded as
    :class:`~gradcomp.exchanges.sparse.FrameworkSparse` in ``stats()``."""
    grad = bucket.buffer()
    FrameworkSparse.record(engine.telemetry.record, bucket.index(), grad)

    def averaged(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()  # the sum, a tensor Gloo's sparse allreduce made: owned here too (gradcomp.inflight)
        inflight.keep(value)
        return value[0]

    return engine.transport.allreduce_average(grad, str(bucket.index())).then(inflight.watch(averaged))


@speaks_to_caller
def register(
    model: torch.nn.Module,
    compressor,
    *,
    optimizer=None,
    total_steps: Optional[int] = None,
    scheduler=None,
    min_compression: Optional[float] = None,
    **state_kwargs,
) -> CompressionState:
    """Compress ``model``'s gradient exchange with ``compressor`` and return the state.

    ``model`` is a ``DistributedDataParallel`` model, or ``torch.compile`` of one (the hook goes on
    the DDP model inside); a compiled module inside DDP works as is. Parameter names lose the
    wrappers' prefixes (:func:`gradcomp.setup.unwrapped_names`).

    With ``total_steps=`` (and ``optimizer=``, ``scheduler=``; the one-call recipe,
    :mod:`gradcomp.recipe`): the schedule and the optimizer-aware stage are derived from the run,
    and ``state.recipe`` says what was chosen. Without it: plain error feedback with 2 dense steps
    into whatever optimizer runs (a warning says so), or the expert's own ``schedule=`` and
    ``transform=``. The rules are :func:`gradcomp.setup.prepare`'s, the same for every integration.

    ``compressor`` is a :class:`gradcomp.Compressor` or its spec (``"topk:0.01"``);
    ``state_kwargs`` go to :class:`CompressionState`. Fails here, before any training step, for a
    bad backend name (argument or ``$GRADCOMP_BACKEND``), a backend that cannot run on the
    model's device, gradient dtypes the compressor cannot take, and an optimizer stage that does
    not know every parameter's name.
    """
    ddp = _ddp_of(model)
    state_kwargs.setdefault("process_group", ddp.process_group)
    rank = dist.get_rank(state_kwargs["process_group"]) if dist.is_initialized() else 0
    setup = prepare(compressor, ddp.module.named_parameters(), optimizer=optimizer, total_steps=total_steps,
                    scheduler=scheduler, min_compression=min_compression, announce=rank == 0, **state_kwargs)
    state = CompressionState(setup.compressor, named_parameters=setup.named, **setup.settings)
    state.recipe = setup.recipe
    ddp.register_comm_hook(state, compression_hook)
    return state


def _ddp_of(model) -> torch.nn.parallel.DistributedDataParallel:
    """The DDP model that ``model`` is or that ``torch.compile`` wraps."""
    inner = getattr(model, "_orig_mod", None)
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        return inner
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() needs a DistributedDataParallel model (or torch.compile of one), "
                        f"got {type(model).__name__}; a fully_shard (FSDP2) model registers with "
                        "gradcomp.hooks.fsdp.register")
    if getattr(model, "_use_python_reducer", False):
        # Compiled autograd's Python reducer calls a comm hook once per parameter as
        # hook(state, (grad, param)) and ignores what it returns: no bucket, no future, no exchange.
        raise RuntimeError("this DistributedDataParallel model was built under torch._dynamo.config.optimize_ddp="
                           "'python_reducer' (compiled autograd), which calls comm hooks per parameter without a "
                           "bucket; gradcomp needs DDP's own reducer: build the DDP model under the default "
                           "optimize_ddp ('ddp_optimizer'), which torch.compile supports with the hook")
    return model
