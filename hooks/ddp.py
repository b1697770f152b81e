"""DDP communication hook: compress each gradient bucket, exchange, average in place.

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
import time
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from gradcomp.backends import BACKENDS, resolve_backend
from gradcomp.compressors.base import Compressor
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchange import allgather_payload, average_gathered, group_size

__all__ = ["CompressionState", "compression_hook", "register"]


class CompressionState:
    """State of :func:`compression_hook`: settings, residuals, step counter, telemetry.

    Args:
        compressor: a :class:`gradcomp.Compressor` (``TopK``, ``TwoBit``, ``FP16``, ...).
        process_group: the group to exchange over; ``None`` is the default group.
        warmup_steps: steps that use a plain dense allreduce before compression starts.
            Residuals are keyed by parameter, so DDP's bucket rebuild after iteration 1
            is safe at any value; the default 2 still waits for it, as PowerSGD does,
            so that the first compressed steps see the final buckets.
        min_numel: buckets with fewer elements go dense (compression would save little
            and cost a kernel launch and an allgather of P payloads).
        error_feedback: keep residuals (only for compressors that drop information).
        named_parameters: ``model.named_parameters()`` of the wrapped module; gives the
            residuals names that survive a restart. :func:`register` passes it.
        backend: kernel backend override (``"torch"``, ``"numba"``, ``"cuda"``).
    """

    __slots__ = [
        # hyperparameters
        "compressor",
        "process_group",
        "warmup_steps",
        "min_numel",
        "error_feedback",
        "backend",
        # internal state
        "step",
        "residuals",
        "_param_names",
        "_step_stats",
        "_last_step_stats",
        "_totals",
    ]

    def __init__(
        self,
        compressor: Compressor,
        process_group: Optional[dist.ProcessGroup] = None,
        warmup_steps: int = 2,
        min_numel: int = 4096,
        error_feedback: bool = True,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        backend: Optional[str] = None,
    ):
        if not isinstance(compressor, Compressor):
            raise TypeError(
                f"compressor must be a gradcomp.Compressor such as gradcomp.TopK(0.01) or "
                f"gradcomp.TwoBit(0.5), got {type(compressor).__name__}"
            )
        for name, value in (("warmup_steps", warmup_steps), ("min_numel", min_numel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        self.compressor = compressor
        self.process_group = process_group
        self.warmup_steps = warmup_steps
        self.min_numel = min_numel
        self.error_feedback = bool(error_feedback)
        self.backend = backend
        self.step = 0
        self.residuals = ErrorFeedback()
        self._param_names: Optional[Dict[int, str]] = None
        if named_parameters is not None:
            self.attach(named_parameters)
        self._step_stats: Dict[int, dict] = {}
        self._last_step_stats: Dict[int, dict] = {}
        self._totals = {"bytes_sent": 0, "dense_bytes": 0, "compress_s": 0.0, "steps": 0}

    def attach(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]]) -> None:
        """Name the parameters, so residuals are saved and restored by name."""
        self._param_names = {id(param): name for name, param in named_parameters}

    # -- pickling: drop what cannot cross a process boundary, as PowerSGDState does ----
    def __getstate__(self):
        state = {slot: getattr(self, slot) for slot in self.__slots__ if slot not in ("process_group", "_param_names")}
        return state

    def __setstate__(self, state):
        self.process_group = None
        self._param_names = None
        for slot, value in state.items():
            setattr(self, slot, value)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"step", "world_size", "residuals": {param name: float32 tensor}}``: this rank's
        state. Save one per rank beside the model and optimizer; it loads with
        ``torch.load(..., weights_only=True)``."""
        if self._param_names is None and self.residuals.keys():
            raise RuntimeError(
                "residuals are keyed by parameter identity because no names were given; "
                "create the state with gradcomp.hooks.ddp.register(model, ...) or "
                "CompressionState(..., named_parameters=model.module.named_parameters())"
            )
        return {
            "step": self.step,
            "world_size": group_size(self.process_group) if dist.is_initialized() else 1,
            "residuals": self.residuals.state_dict()["residuals"],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict`. If the world size changed, residuals are reset with
        a warning: each residual is one rank's private error and has no meaning for a
        different set of ranks. The step counter is restored either way."""
        missing = {"step", "world_size", "residuals"} - set(state_dict)
        if missing:
            raise ValueError(f"state_dict lacks {sorted(missing)}; pass the dict from CompressionState.state_dict()")
        self.step = int(state_dict["step"])
        world_size = group_size(self.process_group) if dist.is_initialized() else 1
        if int(state_dict["world_size"]) != world_size:
            warnings.warn(
                f"gradcomp: checkpoint was saved with world size {state_dict['world_size']} and is "
                f"loaded with {world_size}; error-feedback residuals are reset to zero"
            )
            self.residuals.reset()
        else:
            self.residuals.load_state_dict({"residuals": state_dict["residuals"]})

    # -- telemetry ---------------------------------------------------------------------
    def _record(self, bucket_index: int, bytes_sent: int, dense_bytes: int, compress_s: float, mode: str,
                backend: Optional[str] = None) -> None:
        self._step_stats[bucket_index] = {
            "bytes_sent": bytes_sent,
            "dense_bytes": dense_bytes,
            "compress_s": compress_s,
            "mode": mode,
            "backend": backend,
        }
        self._totals["bytes_sent"] += bytes_sent
        self._totals["dense_bytes"] += dense_bytes
        self._totals["compress_s"] += compress_s

    def _end_step(self) -> None:
        self._last_step_stats = self._step_stats
        self._step_stats = {}
        self._totals["steps"] += 1
        self.step += 1

    def stats(self) -> dict:
        """Bytes this rank handed to collectives and time spent compressing.

        Returns ``{"step": int, "last_step": {...}, "total": {...}}`` where each part has
        ``bytes_sent``, ``dense_bytes`` (what a dense allreduce of the same buckets would
        hand over), ``ratio`` (dense ÷ sent) and ``compress_s``; ``last_step`` also has
        ``buckets``: ``{bucket index: {..., "mode": "dense" | "compressed", "backend"}}``
        where ``backend`` is the kernel backend that compressed the bucket (``None``
        for an allreduce).
        """

        def summary(parts: dict) -> dict:
            sent, dense = parts["bytes_sent"], parts["dense_bytes"]
            return {**parts, "ratio": dense / sent if sent else float("nan")}

        last = self._last_step_stats
        last_totals = {
            "bytes_sent": sum(b["bytes_sent"] for b in last.values()),
            "dense_bytes": sum(b["dense_bytes"] for b in last.values()),
            "compress_s": sum(b["compress_s"] for b in last.values()),
        }
        return {
            "step": self.step,
            "last_step": {**summary(last_totals), "buckets": {i: dict(b) for i, b in last.items()}},
            "total": summary(dict(self._totals)),
        }

    # -- helpers for the hook ------------------------------------------------------------
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


def _dense_allreduce(state: CompressionState, bucket: dist.GradBucket, mode: str) -> torch.futures.Future:
    """Average with one allreduce of the cast payload, as torch's default and fp16 hooks do."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = group_size(group)
    grad = bucket.buffer()
    compressor = state.compressor if mode == "compressed" else None
    wire_dtype = getattr(compressor, "wire_dtype", None) or grad.dtype
    if mode == "dense":
        _flush_residuals(state, bucket, grad)
    # Scaling before the sum keeps fp16 from overflowing; multiplying by 1/P (not
    # dividing by P) is what DDP's built-in reducer does, so the Identity compressor is
    # bitwise equal to DDP without a hook.
    wire = grad if wire_dtype == grad.dtype else grad.to(wire_dtype)
    wire.mul_(1.0 / world_size)
    state._record(bucket.index(), wire.numel() * wire.element_size(), grad.numel() * grad.element_size(), 0.0, mode)
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def decompress(fut):
        reduced = _collective_result(fut, bucket)
        if reduced.data_ptr() != grad.data_ptr():
            grad.copy_(reduced)
        return grad

    return fut.then(decompress)


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


def _flush_residuals(state: CompressionState, bucket: dist.GradBucket, grad: torch.Tensor) -> None:
    """A bucket that goes dense after being compressed sends its residuals along, so
    nothing held back is lost (happens when buckets are rebuilt across ``min_numel``)."""
    if not state.residuals.keys():
        return
    offset = 0
    for key, param_grad in zip(state._keys(bucket), bucket.gradients()):
        residual = state.residuals.residual(key)
        n = param_grad.numel()
        if residual is not None:
            grad[offset : offset + n].add_(residual.to(grad.dtype))
            residual.zero_()
        offset += n


def compression_hook(state: "CompressionState", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that compresses ``bucket`` with ``state.compressor``.

    For a compressor whose payloads cannot be summed (``TopK``, ``TwoBit``):

    1. ``acc = grad + residual`` per parameter, compressed in one fused kernel that also
       writes the new residual (:class:`gradcomp.ErrorFeedback`);
    2. the fixed-size payloads of all ranks are allgathered into one flat buffer;
    3. in one ``.then``: every rank decodes all payloads in rank order, sums them in
       float32, divides by the world size and writes the result into ``bucket.buffer()``;
       the residual update is committed only if the result is finite.

    Summable compressors (``Identity``, ``FP16``, ``BF16``), warm-up steps and buckets
    under ``min_numel`` use one allreduce instead.

    Example::
        >>> state = CompressionState(gradcomp.TwoBit(0.5), named_parameters=net.named_parameters())
        >>> ddp_model.register_comm_hook(state, compression_hook)
    """
    grad = bucket.buffer()
    try:
        if state.step < state.warmup_steps or grad.numel() < state.min_numel:
            return _dense_allreduce(state, bucket, "dense")
        if state.compressor.summable:
            return _dense_allreduce(state, bucket, "compressed")
        return _compressed_exchange(state, bucket)
    finally:
        if bucket.is_last():
            state._end_step()


def _compressed_exchange(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future:
    compressor, backend = state.compressor, state.backend
    grad = bucket.buffer()
    keys = state._keys(bucket)
    use_feedback = state.error_feedback and compressor.uses_error_feedback

    started = time.perf_counter()
    if use_feedback:
        numels = [g.numel() for g in bucket.gradients()]
        if sum(numels) != grad.numel():
            raise RuntimeError(f"bucket buffer has {grad.numel()} elements but its gradients {sum(numels)}")
        residual, residual_out = state.residuals.buffers(keys, numels, grad.device)
        payload = compressor.compress(grad, residual, residual_out, backend=backend)
    else:
        payload = compressor.compress(grad, backend=backend)
    compress_s = time.perf_counter() - started

    state._record(bucket.index(), payload.nbytes, grad.numel() * grad.element_size(), compress_s, "compressed",
                  resolve_backend(grad.device, backend))
    layout = payload.layout
    fut = allgather_payload(payload, state.process_group)

    def decompress(fut):
        gathered = _collective_result(fut, bucket)
        out = grad if grad.dtype == torch.float32 else torch.empty(grad.numel(), dtype=torch.float32, device=grad.device)
        average_gathered(compressor, layout, gathered, out, backend)
        if use_feedback:
            # Commit e' only if no rank sent NaN/Inf; the decision stays on the device.
            state.residuals.commit(keys, torch.isfinite(out).all())
        if out is not grad:
            grad.copy_(out)
        return grad

    return fut.then(decompress)


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor, **state_kwargs) -> CompressionState:
    """Build a :class:`CompressionState` for ``model``, register :func:`compression_hook`
    on it and return the state. ``state_kwargs`` go to :class:`CompressionState`."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"register() needs a DistributedDataParallel model, got {type(model).__name__}")
    state_kwargs.setdefault("process_group", model.process_group)
    state = CompressionState(compressor, named_parameters=model.module.named_parameters(), **state_kwargs)
    model.register_comm_hook(state, compression_hook)
    return state
