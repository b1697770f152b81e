"""Horovod integration: gradcomp compressors inside Horovod, with no patching of Horovod.

Two entry points:

* :class:`Compression` -- Horovod compression classes (``compress(t) -> (t, ctx)``,
  ``decompress(t, ctx)``) backed by any *summable* gradcomp compressor, for the stock
  ``hvd.DistributedOptimizer(opt, compression=...)``::

      >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
      ...                                compression=gradcomp.hooks.horovod.Compression.fp16)

* :func:`DistributedOptimizer` -- a drop-in for ``hvd.DistributedOptimizer`` with the
  same arguments (plus ``warmup_steps``, ``min_numel``, ``error_feedback``, ``backend``)
  that also takes the compressors whose payloads cannot be summed (``TopK``, ``TwoBit``).
  Each gradient is compressed with error feedback keyed by its parameter name as soon
  as backward produces it, and its fixed-size payload is allgathered asynchronously;
  ``synchronize()`` decodes every rank's payload in rank order and averages in float32,
  so the averaged gradient is bitwise identical on every rank::

      >>> opt = gradcomp.hooks.horovod.DistributedOptimizer(
      ...     opt, named_parameters=model.named_parameters(), compression=gradcomp.TopK(0.01))
      >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)
      >>> # ... loss.backward(); opt.step(); opt.zero_grad() as usual
      >>> opt.stats()["last_step"]["ratio"]   # dense bytes / bytes sent

bfloat16: Horovod 0.28.1's torch bindings have no bfloat16 allreduce (on CPU or CUDA;
``horovod_torch_allreduce_async_torch_BFloat16Tensor`` does not exist), so
``Compression.bf16`` raises a ``TypeError`` that says what to use instead when the
installed Horovod cannot sum bfloat16. The drop-in optimizer sends a wire dtype that
Horovod cannot allreduce by allgather instead, which for two ranks moves the same bytes.
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch

try:
    import horovod
    import horovod.torch as hvd
    from horovod.torch import compression as _hvd_compression
    from horovod.torch import mpi_ops as _hvd_mpi_ops
    from horovod.torch import optimizer as _hvd_optimizer
    from horovod.common.util import split_list
    from horovod.torch.mpi_ops import Average, Sum, global_process_set
except ImportError as error:  # pragma: no cover - exercised only without Horovod
    raise ImportError(
        f"gradcomp.hooks.horovod needs Horovod with PyTorch support ({error}). Build and install "
        "it with scripts/build_horovod.sh (Horovod 0.28.1 with Gloo), or pip install gradcomp[horovod]"
    ) from error

from gradcomp.backends import BACKENDS
from gradcomp.compressors import BF16, FP16, Cast, Compressor, Identity
from gradcomp.compressors.base import FLOAT_DTYPES
from gradcomp.error_feedback import ErrorFeedback
from gradcomp.exchange import average_gathered
from gradcomp.payload import Payload

__all__ = ["Compression", "GradcompCompression", "DistributedOptimizer"]


# ---------------------------------------------------------------------------------------
# What the installed Horovod can allreduce
# ---------------------------------------------------------------------------------------
_ALLREDUCE_SUPPORT: Dict[Tuple[torch.dtype, str], bool] = {}


def horovod_can_allreduce(dtype: torch.dtype, device) -> bool:
    """Whether the installed Horovod has an allreduce for ``dtype`` tensors on ``device``.

    Read from the bindings Horovod dispatches to (``horovod_torch_allreduce_async_<type>``),
    so a later Horovod that adds bfloat16 is used as soon as it is installed.
    """
    device = torch.device(device)
    key = (dtype, device.type)
    if key not in _ALLREDUCE_SUPPORT:
        type_name = torch.empty(0, dtype=dtype, device=device).type()
        function = "horovod_torch_allreduce_async_" + type_name.replace(".", "_")
        _ALLREDUCE_SUPPORT[key] = hasattr(_hvd_mpi_ops.mpi_lib, function)
    return _ALLREDUCE_SUPPORT[key]


def _wire_dtype(compressor: Compressor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a summable compressor's single ``data`` segment has for ``dtype`` input."""
    return compressor.layout(1, dtype).segments[0].dtype


def _check_summable(compressor: Compressor) -> None:
    if not compressor.summable:
        raise TypeError(
            f"{compressor!r} payloads cannot be summed by an allreduce, so it cannot be a Horovod "
            f"compression. Use gradcomp.hooks.horovod.DistributedOptimizer(optimizer, "
            f"named_parameters=model.named_parameters(), compression={compressor!r}), which "
            f"allgathers the payloads and keeps error feedback per parameter."
        )
    names = [segment.name for segment in compressor.layout(1, torch.float32).segments]
    if names != ["data"]:
        raise TypeError(f"{compressor!r} is marked summable but its payload has segments {names}, not ['data']")


# ---------------------------------------------------------------------------------------
# Horovod compression backed by gradcomp compressors
# ---------------------------------------------------------------------------------------
class GradcompCompression(_hvd_compression.Compressor):
    """Base of the Horovod compression classes that :meth:`Compression.wrap` makes.

    ``compress`` writes the tensor's payload (one summable ``data`` segment) and returns
    a view of it for Horovod to allreduce in place; ``decompress`` decodes the reduced
    payload back into the tensor's dtype and shape. Non-float tensors pass through.
    """

    compressor: Compressor = Identity()

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if tensor.is_sparse or tensor.dtype not in FLOAT_DTYPES:
            return tensor, None
        wire_dtype = _wire_dtype(cls.compressor, tensor.dtype)
        if isinstance(cls.compressor, Cast) and wire_dtype == tensor.dtype:
            return tensor, None  # a cast to its own dtype: the tensor is its payload
        if not horovod_can_allreduce(wire_dtype, tensor.device):
            raise TypeError(
                f"the installed Horovod {horovod.__version__} cannot allreduce {wire_dtype} tensors on "
                f"{tensor.device.type} (its torch bindings have no such allreduce), so {cls.__name__} "
                f"cannot be used with hvd.DistributedOptimizer. Use Compression.fp16, or "
                f"gradcomp.hooks.horovod.DistributedOptimizer(..., compression={cls.compressor!r}), "
                f"which sends this payload by allgather instead."
            )
        payload = cls.compressor.compress(tensor.reshape(-1))
        return payload["data"].view(tensor.shape), (payload, tensor.dtype)

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        payload, dtype = ctx
        data = payload["data"]
        if tensor.data_ptr() != data.data_ptr():  # an out-of-place allreduce (hvd.allreduce)
            data.copy_(tensor.reshape(-1))
        out = torch.empty(tensor.shape, dtype=dtype, device=tensor.device)
        cls.compressor.decompress(payload, out.view(-1))
        return out


class Compression:
    """Horovod compression options; pass one as ``hvd.DistributedOptimizer(compression=...)``.

    * ``Compression.none``: Horovod's own no-op compression.
    * ``Compression.fp16``: gradients travel as float16 (:class:`gradcomp.FP16`).
    * ``Compression.bf16``: gradients travel as bfloat16 (:class:`gradcomp.BF16`); needs a
      Horovod with a bfloat16 allreduce, which 0.28.1 lacks (see the module docstring).
    * ``Compression.wrap(compressor)``: any summable gradcomp compressor.
    """

    none = _hvd_compression.Compression.none

    @staticmethod
    def wrap(compressor: Compressor) -> type:
        """A Horovod compression class backed by ``compressor``.

        Raises ``TypeError`` for compressors whose payloads cannot be summed (``TopK``,
        ``TwoBit``): use :func:`DistributedOptimizer` for those.
        """
        if isinstance(compressor, type) and issubclass(compressor, Compressor):
            raise TypeError(f"pass a compressor instance, e.g. {compressor.__name__}(), not the class")
        if not isinstance(compressor, Compressor):
            raise TypeError(f"expected a gradcomp.Compressor such as gradcomp.FP16(), got {type(compressor).__name__}")
        _check_summable(compressor)
        name = f"Gradcomp{type(compressor).__name__}Compression"
        return type(name, (GradcompCompression,), {"compressor": compressor})


Compression.fp16 = Compression.wrap(FP16())
Compression.bf16 = Compression.wrap(BF16())


def _as_compressor(compression) -> Optional[Compressor]:
    """The gradcomp compressor behind ``compression``; ``None`` for a foreign Horovod one."""
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, type):
        if issubclass(compression, GradcompCompression):
            return compression.compressor
        if issubclass(compression, Compressor):
            raise TypeError(f"pass a compressor instance, e.g. gradcomp.{compression.__name__}(...), not the class")
        if compression is _hvd_compression.NoneCompressor:
            return Identity()
        if compression is _hvd_compression.FP16Compressor:
            return FP16()
    if callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None)):
        return None
    raise TypeError(
        "compression must be a gradcomp compressor (gradcomp.TopK(0.01), gradcomp.TwoBit(0.5), "
        "gradcomp.FP16(), ...) or a Horovod compression (hvd.Compression.none, "
        f"gradcomp.hooks.horovod.Compression.fp16, ...), got {compression!r}"
    )


# ---------------------------------------------------------------------------------------
# The drop-in distributed optimizer
# ---------------------------------------------------------------------------------------
class _Unit:
    """Parameters exchanged together: one parameter, or one group of ``groups``."""

    __slots__ = ("params", "names", "numels", "numel", "name")

    def __init__(self, params, names):
        self.params: Tuple[torch.nn.Parameter, ...] = tuple(params)
        self.names: Tuple[str, ...] = tuple(names)
        self.numels: Tuple[int, ...] = tuple(p.numel() for p in self.params)
        self.numel = sum(self.numels)
        self.name = self.names[0] if len(self.names) == 1 else "+".join(self.names)


class _Exchange:
    """One unit's exchange in flight, from launch in a backward hook to ``synchronize``."""

    __slots__ = ("mode", "handle", "flat", "flat_is_grad", "payload", "resparsify")

    def __init__(self, mode, handle, flat=None, flat_is_grad=False, payload=None, resparsify=()):
        self.mode: str = mode  # "dense" | "sparse" | "allreduce" | "allgather"
        self.handle = handle
        self.flat: Optional[torch.Tensor] = flat  # the unit's gradients as one flat tensor
        self.flat_is_grad = flat_is_grad  # flat is a view of the one gradient: no copy back
        self.payload: Optional[Payload] = payload
        self.resparsify = resparsify  # params whose sparse grads were densified


def _flatten(grads: List[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    """``(flat, is_view)``: a view of a single contiguous gradient, else a concatenated copy."""
    if len(grads) == 1 and grads[0].is_contiguous():
        return grads[0].view(-1), True
    return torch.cat([g.reshape(-1) for g in grads]), False


def _unflatten(flat: torch.Tensor, grads: List[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view(g.shape))
        offset += n


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into a subclass of the wrapped optimizer's class, as Horovod does.

    ``super(self.__class__, self)`` is therefore the wrapped optimizer's class. Build it
    with :func:`DistributedOptimizer`, never directly.
    """

    def __init__(
        self,
        params,
        named_parameters,
        compressor: Compressor,
        backward_passes_per_step: int,
        op,
        gradient_predivide_factor: float,
        groups,
        sparse_as_dense: bool,
        process_set,
        warmup_steps: int,
        min_numel: int,
        error_feedback: bool,
        backend: Optional[str],
    ):
        super(self.__class__, self).__init__(params)
        self._compressor = compressor
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._warmup_steps = warmup_steps
        self._min_numel = min_numel
        self._use_feedback = bool(error_feedback) and compressor.uses_error_feedback
        self._backend = backend

        # Names: Horovod's rules and messages, so that a drop-in swap behaves the same.
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        else:
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, param_group in enumerate(self.param_groups)
                for j, v in enumerate(param_group["params"])
            ]
        if any(not isinstance(p, tuple) for p in named_parameters):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), "
                "usually produced by model.named_parameters()."
            )
        seen, dups = set(), set()
        for name, _ in named_parameters:
            (dups if name in seen else seen).add(name)
        if dups:
            raise ValueError(
                "Parameter names in named_parameters must be unique. Found duplicates: %s" % ", ".join(sorted(dups))
            )
        all_param_ids = {id(v) for param_group in self.param_groups for v in param_group["params"]}
        unnamed = all_param_ids - {id(v) for _, v in named_parameters}
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named. "
                "Python object ids: %s" % ", ".join(str(i) for i in unnamed)
            )
        self._parameter_names = {v: k for k, v in named_parameters}

        self._units: List[_Unit] = self._build_units(groups)
        self._unit_of: Dict[torch.nn.Parameter, _Unit] = {p: u for u in self._units for p in u.params}
        self._allreduce_delay = {p: backward_passes_per_step for p in self._unit_of}
        self._ready_count: Dict[_Unit, int] = {u: 0 for u in self._units}
        # unit -> _Exchange in flight, or None while it waits for more backward passes.
        self._handles: Dict[_Unit, Optional[_Exchange]] = {}
        self._hook_handles = []
        self._synchronized = False
        self._should_synchronize = True

        self._residuals = ErrorFeedback()
        self._exchange_step = 0
        self._step_stats: Dict[str, dict] = {}
        self._last_step_stats: Dict[str, dict] = {}
        self._totals = {"bytes_sent": 0, "dense_bytes": 0, "compress_s": 0.0, "steps": 0}

        if self.process_set.included():
            self._register_hooks()

    # -- set-up -----------------------------------------------------------------------
    def _build_units(self, groups) -> List[_Unit]:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        name = self._parameter_names.get
        if groups is None:
            return [_Unit([p], [name(p)]) for p in params]
        if isinstance(groups, list):
            ids = {id(p) for p in params}
            param_groups = [[p for p in group if id(p) in ids] for group in groups]
            grouped = {id(p) for group in param_groups for p in group}
            param_groups = [g for g in param_groups if g] + [[p] for p in params if id(p) not in grouped]
        else:
            # Same split as Horovod: rank 0's parameter order, cut into `groups` pieces.
            order = _broadcast_names([name(p) for p in params], self.process_set)
            params = sorted(params, key=lambda p: order.index(name(p)))
            param_groups = [g for g in split_list(params, groups) if g]
        units = []
        for group in param_groups:
            dtypes = {p.dtype for p in group}
            if len(dtypes) > 1:
                listing = ", ".join(f"{name(p)}: {p.dtype}" for p in group)
                raise ValueError(
                    f"a group is compressed as one flat tensor, so its parameters must share a dtype; got {listing}"
                )
            units.append(_Unit(group, [name(p) for p in group]))
        return units

    def _register_hooks(self) -> None:
        # The post-accumulate-grad hook is torch's public form of the hook Horovod puts on
        # each parameter's AccumulateGrad node: it fires once p.grad holds this pass's sum.
        for unit in self._units:
            for p in unit.params:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    def _make_hook(self, p):
        def hook(*ignore):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally."
                )
            self._allreduce_delay[p] -= 1
            unit = self._unit_of[p]
            if self._allreduce_delay[p] == 0:
                self._ready_count[unit] += 1
                if self._ready_count[unit] == len(unit.params):
                    self._handles[unit] = self._launch(unit)
                    return
            self._handles.setdefault(unit, None)

        return hook

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    # -- launching one unit's exchange (inside backward) ----------------------------------
    def _mode(self, unit: _Unit, grads: List[torch.Tensor]) -> str:
        dtype = grads[0].dtype
        if dtype not in FLOAT_DTYPES or self._exchange_step < self._warmup_steps or unit.numel < self._min_numel:
            return "dense"
        compressor = self._compressor
        if compressor.summable:
            wire_dtype = _wire_dtype(compressor, dtype)
            if isinstance(compressor, Cast) and wire_dtype == dtype:
                return "dense"  # the tensor is its own payload
            if horovod_can_allreduce(wire_dtype, grads[0].device):
                return "allreduce"
        return "allgather"

    def _launch(self, unit: _Unit) -> _Exchange:
        resparsify = []
        for p in unit.params:
            if p.grad is None:
                # Not computed here but maybe on another rank: every rank must send something.
                p.grad = p.data.new(p.size()).zero_()
            if p.grad.is_sparse and self.sparse_as_dense:
                p.grad = p.grad.to_dense()
                resparsify.append(p)
        grads = [p.grad for p in unit.params]
        if any(g.is_sparse for g in grads):
            if len(grads) > 1:
                raise ValueError(
                    f"group {unit.name} has sparse gradients; pass sparse_as_dense=True to exchange them densely"
                )
            handle = _hvd_mpi_ops.sparse_allreduce_async(
                grads[0], name=unit.name, op=self.op, process_set=self.process_set
            )
            self._record(unit, grads[0]._values().numel() * grads[0].element_size(), grads, 0.0, "sparse")
            return _Exchange("sparse", handle)

        mode = self._mode(unit, grads)
        if mode == "dense":
            return self._launch_dense(unit, grads, resparsify)
        flat, flat_is_grad = _flatten(grads)
        started = time.perf_counter()
        if mode == "allreduce":
            payload = self._compressor.compress(flat, backend=self._backend)
            compress_s = time.perf_counter() - started
            wire = payload["data"]
            handle = hvd.allreduce_async_(
                wire, name=unit.name, op=self.op, process_set=self.process_set, **self._scale()
            )
            self._record(unit, wire.numel() * wire.element_size(), grads, compress_s, mode)
            return _Exchange(mode, handle, flat, flat_is_grad, payload, resparsify)

        if self._use_feedback:
            residual, residual_out = self._residuals.buffers(unit.names, unit.numels, flat.device)
            payload = self._compressor.compress(flat, residual, residual_out, backend=self._backend)
        else:
            payload = self._compressor.compress(flat, backend=self._backend)
        compress_s = time.perf_counter() - started
        # Horovod's CPU allreduce rejects int8, and a wider integer view moves the same bytes;
        # payload sizes are multiples of 8, so the int64 view always exists.
        wire = payload.buffer.view(torch.int64 if payload.nbytes % 8 == 0 else torch.uint8)
        handle = hvd.allgather_async(wire, name=f"gradcomp.{unit.name}", process_set=self.process_set)
        self._record(unit, payload.nbytes, grads, compress_s, mode)
        return _Exchange(mode, handle, flat, flat_is_grad, payload, resparsify)

    def _launch_dense(self, unit: _Unit, grads: List[torch.Tensor], resparsify) -> _Exchange:
        self._flush_residuals(unit, grads)
        flat, is_view = _flatten(grads)
        # Horovod's own path for one contiguous gradient: an in-place allreduce of p.grad.
        handle = hvd.allreduce_async_(flat, name=unit.name, op=self.op, process_set=self.process_set, **self._scale())
        self._record(unit, flat.numel() * flat.element_size(), grads, 0.0, "dense")
        return _Exchange("dense", handle, flat, is_view, None, resparsify)

    def _scale(self) -> dict:
        if self.op == Average:
            # As Horovod: split the average across pre- and post-scaling; the 1 / size
            # factor is applied after the sum by Horovod itself.
            return {
                "prescale_factor": 1.0 / self.gradient_predivide_factor,
                "postscale_factor": self.gradient_predivide_factor,
            }
        return {}

    def _flush_residuals(self, unit: _Unit, grads: List[torch.Tensor]) -> None:
        """A unit that goes dense sends the residual it still holds, so nothing is lost
        (happens when residuals are loaded into a run that is still warming up)."""
        if not self._residuals.keys():
            return
        for name, grad in zip(unit.names, grads):
            residual = self._residuals.residual(name)
            if residual is not None:
                grad.add_(residual.view(grad.shape).to(grad.dtype))
                residual.zero_()

    # -- finishing (in synchronize) ---------------------------------------------------
    def _finish(self, unit: _Unit, exchange: _Exchange) -> None:
        grads = [p.grad for p in unit.params]
        if exchange.mode == "sparse":
            aggregated = exchange.handle()
            grads[0].zero_().add_(aggregated)
            return
        output = hvd.synchronize(exchange.handle)
        if exchange.mode == "dense":
            if not exchange.flat_is_grad:
                _unflatten(exchange.flat, grads)
        elif exchange.mode == "allreduce":
            payload = exchange.payload
            if output.data_ptr() != payload["data"].data_ptr():
                payload["data"].copy_(output)
            self._compressor.decompress(payload, exchange.flat, self._backend)
            if not exchange.flat_is_grad:
                _unflatten(exchange.flat, grads)
        else:
            self._finish_allgather(unit, exchange, output, grads)
        for p in exchange.resparsify:
            p.grad = p.grad.to_sparse()

    def _finish_allgather(self, unit: _Unit, exchange: _Exchange, output, grads) -> None:
        layout = exchange.payload.layout
        world_size = self.process_set.size()
        gathered = output.view(torch.uint8)
        if gathered.numel() != world_size * layout.nbytes:
            raise RuntimeError(
                f"allgather of {unit.name} returned {gathered.numel()} bytes, expected {world_size} ranks x "
                f"{layout.nbytes}; ranks disagree on the model, its dtypes or the compressor settings"
            )
        flat = exchange.flat
        in_place = exchange.flat_is_grad and flat.dtype == torch.float32
        out = flat if in_place else torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
        average_gathered(self._compressor, layout, gathered, out, self._backend)
        if self.op == Sum:
            out.mul_(world_size)  # exact when the world size is a power of two
        if self._use_feedback:
            # e' only if no rank sent NaN/Inf; on a GPU the decision stays on the device.
            self._residuals.commit(unit.names, torch.isfinite(out).all())
        if not in_place:
            _unflatten(out, grads)

    def synchronize(self) -> None:
        """Finish every gradient's exchange and write the averages into ``p.grad``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        for unit in self._units:
            if self._handles.get(unit) is None:
                # Not launched by a hook: step() came before backward_passes_per_step passes,
                # or the parameter took no part in this backward.
                self._handles[unit] = self._launch(unit)
        for unit, exchange in self._handles.items():
            self._finish(unit, exchange)
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step
        for unit in self._ready_count:
            self._ready_count[unit] = 0
        self._end_exchange_step()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first)::

            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to "
                    "consider using optimizer.skip_synchronize() context if you use "
                    "optimizer.synchronize() in your code."
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        return super(self.__class__, self).zero_grad(set_to_none)

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self):
        """The wrapped optimizer's state dict plus ``"gradcomp"``: this rank's
        :meth:`compression_state_dict`. Residuals are per rank: save every rank's."""
        state = super(self.__class__, self).state_dict()
        state["gradcomp"] = self.compression_state_dict()
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        compression_state = state_dict.pop("gradcomp", None)
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        for unit in self._ready_count:
            self._ready_count[unit] = 0
        super(self.__class__, self).load_state_dict(state_dict)
        if compression_state is not None:
            self.load_compression_state_dict(compression_state)

    def compression_state_dict(self) -> dict:
        """``{"step", "world_size", "rank", "residuals": {param name: float32 tensor}}``;
        loads with ``torch.load(..., weights_only=True)``."""
        return {
            "step": self._exchange_step,
            "world_size": self.process_set.size(),
            "rank": self.process_set.rank(),
            "residuals": self._residuals.state_dict()["residuals"],
        }

    def load_compression_state_dict(self, state: dict) -> None:
        """Restore :meth:`compression_state_dict`. Residuals saved by another rank or world
        size are reset to zero with a warning: each is one rank's private error. The step
        counter (which ends warm-up) is restored either way."""
        missing = {"step", "world_size", "rank", "residuals"} - set(state)
        if missing:
            raise ValueError(f"state lacks {sorted(missing)}; pass the dict from compression_state_dict()")
        self._exchange_step = int(state["step"])
        here = (self.process_set.size(), self.process_set.rank())
        saved = (int(state["world_size"]), int(state["rank"]))
        if saved != here:
            if state["residuals"]:
                warnings.warn(
                    f"gradcomp: residuals were saved by rank {saved[1]} of {saved[0]} and are loaded by "
                    f"rank {here[1]} of {here[0]}; error-feedback residuals are reset to zero"
                )
            self._residuals.reset()
        else:
            self._residuals.load_state_dict({"residuals": state["residuals"]})

    # -- telemetry --------------------------------------------------------------------
    def _record(self, unit: _Unit, bytes_sent: int, grads, compress_s: float, mode: str) -> None:
        dense_bytes = sum(g.numel() * g.element_size() for g in grads)
        self._step_stats[unit.name] = {
            "bytes_sent": bytes_sent,
            "dense_bytes": dense_bytes,
            "compress_s": compress_s,
            "mode": mode,
        }
        self._totals["bytes_sent"] += bytes_sent
        self._totals["dense_bytes"] += dense_bytes
        self._totals["compress_s"] += compress_s

    def _end_exchange_step(self) -> None:
        self._last_step_stats = self._step_stats
        self._step_stats = {}
        self._totals["steps"] += 1
        self._exchange_step += 1

    def stats(self) -> dict:
        """Bytes this rank handed to collectives and time spent compressing.

        Returns ``{"step": int, "last_step": {...}, "total": {...}}``; each part has
        ``bytes_sent``, ``dense_bytes`` (what Horovod's dense allreduce of the same
        gradients would hand over), ``ratio`` (dense / sent) and ``compress_s``;
        ``last_step`` also has ``params``: ``{name: {..., "mode"}}`` where mode is
        ``"dense"``, ``"sparse"``, ``"allreduce"`` (summable payload) or ``"allgather"``.
        """

        def summary(parts: dict) -> dict:
            sent, dense = parts["bytes_sent"], parts["dense_bytes"]
            return {**parts, "ratio": dense / sent if sent else float("nan")}

        last = self._last_step_stats
        last_totals = {key: sum(s[key] for s in last.values()) for key in ("bytes_sent", "dense_bytes", "compress_s")}
        return {
            "step": self._exchange_step,
            "last_step": {**summary(last_totals), "params": {name: dict(s) for name, s in last.items()}},
            "total": summary(dict(self._totals)),
        }

    @property
    def residuals(self) -> ErrorFeedback:
        """This rank's error-feedback memory, keyed by parameter name."""
        return self._residuals


def _broadcast_names(names: List[str], process_set) -> List[str]:
    return hvd.broadcast_object(names, root_rank=0, name="gradcomp.parameter_order", process_set=process_set)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step: int = 1,
    op=Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=global_process_set,
    warmup_steps: int = 0,
    min_numel: int = 1024,
    error_feedback: bool = True,
    backend: Optional[str] = None,
):
    """``hvd.DistributedOptimizer`` that also takes ``TopK`` and ``TwoBit``.

    The first ten arguments are Horovod's, with Horovod's meaning. ``compression`` is a
    gradcomp compressor instance (``gradcomp.TopK(0.01)``, ``gradcomp.TwoBit(0.5)``,
    ``gradcomp.FP16()``, ...) or a Horovod compression class (``hvd.Compression.none``,
    :class:`Compression` options). For each parameter (or each group of ``groups``,
    compressed as one flat tensor, e.g. ``groups=1`` for a global top-k):

    1. once backward has run ``backward_passes_per_step`` times, a hook compresses
       ``acc = grad + residual`` in one fused kernel that also writes the new residual
       (:class:`gradcomp.ErrorFeedback`, keyed by parameter name);
    2. the fixed-size payload starts an ``hvd.allgather_async`` (as an int64 view);
    3. ``synchronize()`` (called by ``step()``) decodes every rank's payload in rank
       order, sums in float32, divides by the world size (:func:`gradcomp.exchange.average_gathered`)
       and writes the result into ``p.grad``; the residual update is committed only if
       the result is finite on every rank.

    Summable compressors go through one ``allreduce`` of the cast payload instead (or
    an allgather when Horovod cannot allreduce the wire dtype, e.g. bfloat16). The first
    ``warmup_steps`` steps, parameters with fewer than ``min_numel`` elements and
    non-float32/16/bf16 gradients use Horovod's dense allreduce.

    Args:
        op: ``hvd.Average`` or ``hvd.Sum`` (``Sum`` is the average times the world size).
            Other ops cannot combine compressed payloads; with a summable compressor they
            are handed to ``hvd.DistributedOptimizer``.
        gradient_predivide_factor: as Horovod's, for the allreduce paths; payloads that are
            allgathered are decoded and summed in float32, where it has no purpose.
        warmup_steps: steps that use the dense allreduce before compression starts.
        min_numel: parameters (groups) with fewer elements go dense.
        error_feedback: keep residuals (for compressors that drop information).
        backend: kernel backend override (``"torch"``, ``"numba"``, ``"cuda"``).

    ``named_parameters`` is required with error feedback, so residuals are saved and
    restored by name. A compression object that is neither gradcomp's nor one of
    Horovod's two built-ins is passed on to ``hvd.DistributedOptimizer`` unchanged.

    Example::
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
        ...                            named_parameters=model.named_parameters(),
        ...                            compression=gradcomp.TopK(0.01), warmup_steps=5)
    """
    compressor = _as_compressor(compression)
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
        )
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    for name, value in (("warmup_steps", warmup_steps), ("min_numel", min_numel)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")

    if compressor is None or (op not in (Average, Sum) and compressor.summable):
        ignored = {"warmup_steps": (warmup_steps, 0), "min_numel": (min_numel, 1024), "backend": (backend, None)}
        changed = sorted(name for name, (value, default) in ignored.items() if value != default)
        if changed:
            warnings.warn(f"gradcomp: {changed} have no effect when hvd.DistributedOptimizer does the exchange")
        horovod_compression = compression if compressor is None else Compression.wrap(compressor)
        return hvd.DistributedOptimizer(
            optimizer, named_parameters, horovod_compression, backward_passes_per_step, op,
            gradient_predivide_factor, 0, groups, sparse_as_dense, process_set,
        )  # fmt: skip
    if op not in (Average, Sum):
        raise ValueError(
            f"op={op!r} cannot combine {compressor!r} payloads: each rank's payload is decoded and the "
            "results are averaged (op=hvd.Average) or summed (op=hvd.Sum). Use one of those, or a "
            "summable compression with hvd.DistributedOptimizer for other ops."
        )
    if named_parameters is None and error_feedback and compressor.uses_error_feedback:
        raise ValueError(
            f"{compressor!r} keeps error-feedback residuals keyed by parameter name, so that they are "
            "saved and restored by name; pass named_parameters=model.named_parameters() "
            "(or error_feedback=False)."
        )

    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    # hvd.broadcast_optimizer_state recognises a distributed optimizer by its module and
    # then initialises state with the wrapped class's step() instead of ours, which would
    # start an exchange. Claim Horovod's module so that it treats this one the same way.
    cls.__module__ = _hvd_optimizer.DistributedOptimizer.__module__
    distributed = cls(
        optimizer.param_groups, named_parameters, compressor, backward_passes_per_step, op,
        gradient_predivide_factor, groups, sparse_as_dense, process_set, warmup_steps, min_numel,
        error_feedback, backend,
    )  # fmt: skip
    # Keep what the wrapped optimizer already accumulated (Horovod starts from empty state).
    distributed.state.update(optimizer.state)
    return distributed
