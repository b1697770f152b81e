"""Horovod compression classes backed by summable gradcomp compressors (as ``horovod/torch/compression.py``).

``compress(t) -> (t, ctx)`` and ``decompress(t, ctx)``, for the stock
``hvd.DistributedOptimizer(opt, compression=...)``::

    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    ...                                compression=gradcomp.hooks.horovod.Compression.fp16)

bfloat16: Horovod 0.28.1's torch bindings have no bfloat16 allreduce (on CPU or CUDA;
``horovod_torch_allreduce_async_torch_BFloat16Tensor`` does not exist), so
``Compression.bf16`` raises a ``TypeError`` that says what to use instead when the installed
Horovod cannot sum bfloat16.

A gradcomp compressor given to Horovod's own optimizer (``compression=gradcomp.TopK(0.01)``)
cannot work: its ``compress`` returns a gradcomp payload, not Horovod's ``(tensor, ctx)``.
:func:`refuse_gradcomp_compressors` (installed by :mod:`gradcomp.hooks.horovod`) makes
``hvd.DistributedOptimizer`` hand such a compressor to Horovod as :func:`refusing`, a Horovod
compression whose ``compress`` raises :func:`refused_by_horovod`: every rank raises the same
``TypeError``, naming the call to use, at its first compress call in the first ``backward()``
(where the optimizer first uses it), before any collective.
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

try:
    import horovod
    import horovod.torch as _hvd_torch
    from horovod.torch import compression as _hvd_compression
except ImportError as error:  # pragma: no cover - exercised only without Horovod
    raise ImportError(
        f"gradcomp.hooks.horovod needs Horovod with PyTorch support ({error}). Build and install "
        "it with scripts/build_horovod.sh (Horovod 0.28.1 with Gloo), or pip install gradcomp[horovod]"
    ) from error

from gradcomp.compressors import BF16, FP16, Cast, Compressor, Identity
from gradcomp.compressors.base import FLOAT_DTYPES
from gradcomp.hooks.horovod.transport import horovod_can_allreduce
from gradcomp.settings import check_compressor

__all__ = ["Compression", "GradcompCompression", "horovod_can_allreduce", "as_compressor", "refused_by_horovod",
           "refusing", "refuse_gradcomp_compressors"]


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


class GradcompCompression(_hvd_compression.Compressor):
    """Base of the Horovod compression classes that :meth:`Compression.wrap` makes.

    ``compress`` writes the tensor's payload (one summable ``data`` segment) and returns
    a view of it for Horovod to allreduce in place; ``decompress`` decodes the reduced
    payload back into the tensor's dtype and shape. Non-float tensors pass through. A cast
    (:class:`gradcomp.FP16`, :class:`gradcomp.BF16`) is one ``Tensor.to`` each way, the values its
    payload holds (on charlm-small's 28 tensors, compress and decompress 0.22 ms a step of one thread,
    0.72 ms through payload objects, Horovod's own fp16 compression 0.14 ms).
    """

    compressor: Compressor = Identity()

    @classmethod
    def compress(cls, tensor: torch.Tensor):
        if tensor.is_sparse or tensor.dtype not in FLOAT_DTYPES:
            return tensor, None
        compressor = cls.compressor
        cast = isinstance(compressor, Cast)
        wire_dtype = (compressor.wire_dtype or tensor.dtype) if cast else _wire_dtype(compressor, tensor.dtype)
        if cast and wire_dtype == tensor.dtype:
            return tensor, None  # a cast to its own dtype: the tensor is its payload
        if not horovod_can_allreduce(wire_dtype, tensor.device):
            raise TypeError(
                f"the installed Horovod {horovod.__version__} cannot allreduce {wire_dtype} tensors on "
                f"{tensor.device.type} (its torch bindings have no such allreduce), so {cls.__name__} "
                f"cannot be used with hvd.DistributedOptimizer. Use Compression.fp16, or "
                f"gradcomp.hooks.horovod.DistributedOptimizer(..., compression={cls.compressor!r}), "
                f"which sends this payload by allgather instead."
            )
        if cast:  # the cast's payload is the tensor converted: one conversion, as Horovod's own fp16 compression
            return tensor.to(wire_dtype, memory_format=torch.contiguous_format), tensor.dtype
        payload = compressor.compress(tensor.reshape(-1))
        return payload["data"].view(tensor.shape), (payload, tensor.dtype)

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx):
        """The reduced ``tensor`` in the gradient's dtype and shape. ``ctx``: ``None`` (sent as it is), the
        gradient's dtype (a cast), or ``(payload, dtype)``."""
        if ctx is None:
            return tensor
        if isinstance(ctx, torch.dtype):  # Cast.decompress's one conversion, of whatever tensor the allreduce gave
            return tensor.to(ctx)
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
        ``TwoBit``): use :func:`~gradcomp.hooks.horovod.DistributedOptimizer` for those.
        """
        if not isinstance(compressor, Compressor) and not isinstance(compressor, type):
            raise TypeError(f"expected a gradcomp.Compressor such as gradcomp.FP16(), got {type(compressor).__name__}")
        _check_summable(check_compressor(compressor))
        name = f"Gradcomp{type(compressor).__name__}Compression"
        return type(name, (GradcompCompression,), {"compressor": compressor})


Compression.fp16 = Compression.wrap(FP16())
Compression.bf16 = Compression.wrap(BF16())


def as_compressor(compression) -> Optional[Compressor]:
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


def refused_by_horovod(compressor) -> TypeError:
    """The error for a compressor (instance, or class by mistake) given to Horovod's own
    ``hvd.DistributedOptimizer(compression=...)``."""
    if isinstance(compressor, type):
        compressor = f"gradcomp.{compressor.__name__}(...)"  # shown as the instance to pass
        summable = False
    else:
        summable = compressor.summable
        compressor = repr(compressor)
    # A summable payload fits Horovod's allreduce once wrapped as a Horovod compression class.
    instead = f"compression=gradcomp.hooks.horovod.Compression.wrap({compressor}) with hvd's optimizer, or " \
        if summable else ""
    return TypeError(
        f"{compressor} was passed to Horovod's own hvd.DistributedOptimizer(compression=...), which "
        "expects a Horovod compression class (compress(t) -> (t, ctx)) and cannot carry gradcomp "
        f"payloads. Use {instead}the drop-in optimizer with the same arguments: "
        "gradcomp.hooks.horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), "
        f"compression={compressor})"
    )


def refusing(compressor) -> type:
    """A Horovod compression class whose ``compress`` raises :func:`refused_by_horovod` for ``compressor``."""

    def compress(tensor):
        raise refused_by_horovod(compressor)

    def decompress(tensor, ctx):
        raise refused_by_horovod(compressor)

    return type("RefusedGradcompCompression", (_hvd_compression.Compressor,),
                {"compress": staticmethod(compress), "decompress": staticmethod(decompress)})


def refuse_gradcomp_compressors(horovod_torch=None) -> None:
    """Make ``horovod_torch.DistributedOptimizer`` (default: ``horovod.torch``'s) hand a gradcomp
    compressor (instance or class) to Horovod as :func:`refusing`; every other argument, and every
    other compression, reaches Horovod unchanged. Idempotent.

    Horovod's optimizer only stores ``compression`` when it is built and first calls ``compress``
    from the gradient hook in the first ``backward()``; without this, that call would fail further
    on, with an error that says nothing of the fix.
    """
    module = horovod_torch if horovod_torch is not None else _hvd_torch
    original = module.DistributedOptimizer
    if getattr(original, "refuses_gradcomp_compressors", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def DistributedOptimizer(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        compression = bound.arguments.get("compression")
        if isinstance(compression, Compressor) or (isinstance(compression, type) and issubclass(compression,
                                                                                               Compressor)):
            bound.arguments["compression"] = refusing(compression)
        return original(*bound.args, **bound.kwargs)

    DistributedOptimizer.refuses_gradcomp_compressors = True
    module.DistributedOptimizer = DistributedOptimizer
