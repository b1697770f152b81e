"""The engine's settings: one set of defaults and one validation for DDP and Horovod.

Defaults, chosen once for both integrations:

* ``warmup_steps = 2``: DDP rebuilds its buckets after the first iteration; two dense steps
  let compression start on the final buckets (as PowerSGD's ``start_powerSGD_iter``
  advises), and keep the largest early gradients out of the residuals. For top-k and 2-bit
  the measured schedules of :mod:`gradcomp.schedule` do better; pass one as ``schedule=``.
* ``min_numel = 1024``: a group of fewer elements (4 KiB of float32) goes dense. Its
  compressed payload would save at most a few KiB, while it still costs a kernel launch and
  an allgather of ``P`` payloads instead of one allreduce; Horovod's per-parameter biases and
  norms fall below it, weight matrices and DDP buckets lie far above it.
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from gradcomp.backends import BACKENDS, resolve_backend
from gradcomp.compressors.base import FLOAT_DTYPES, Compressor

__all__ = ["DEFAULT_WARMUP_STEPS", "DEFAULT_MIN_NUMEL", "check_compressor", "check_count", "check_backend",
           "check_gradient_dtypes", "check_decay", "check_schedule", "check_transform", "loss_scale",
           "check_backend_name"]

#: What the engine calls on every ``transform`` (see :mod:`gradcomp.engine`; ``commit`` and ``after_average`` are
#: optional).
TRANSFORM_METHODS = ("before_compress", "after_compress", "dense", "state_dict", "load_state_dict")

DEFAULT_WARMUP_STEPS = 2
DEFAULT_MIN_NUMEL = 1024


def check_compressor(compressor) -> Compressor:
    """``compressor`` if it is a gradcomp compressor instance, else a ``TypeError`` that says what to pass."""
    if isinstance(compressor, type) and issubclass(compressor, Compressor):
        raise TypeError(f"pass a compressor instance, e.g. gradcomp.{compressor.__name__}(...), not the class")
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressor must be a gradcomp.Compressor such as gradcomp.TopK(0.01) or "
            f"gradcomp.TwoBit(0.5), got {type(compressor).__name__}"
        )
    return compressor


def check_count(name: str, value) -> int:
    """``value`` if it is an integer >= 0, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_decay(value) -> float:
    """``value`` as a float if it is a residual decay in (0, 1], else a ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"residual_decay must be a number in (0, 1] (1: plain error feedback), got {value!r}")
    return float(value)


def check_backend_name(backend: Optional[str]) -> Optional[str]:
    """``backend`` if it is a backend's name or ``None`` (chosen by device), else ``ValueError``."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def check_backend(backend: Optional[str], device) -> str:
    """Resolve the kernel backend for ``device`` now (argument, else ``$GRADCOMP_BACKEND``, else
    automatic), so that a bad name or a missing dependency fails at set-up, not inside a hook."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return resolve_backend(device, backend)


def check_gradient_dtypes(named_dtypes: Iterable[Tuple[str, torch.dtype]], compressor: Compressor) -> None:
    """Raise ``TypeError`` naming the parameters whose gradients ``compressor`` cannot take.

    Gradcomp compresses float32, float16 and bfloat16 gradients; a compressor whose payload
    is the gradient itself (``Identity``) takes any dtype, since that is a plain allreduce.
    """
    bad = [(name, dtype) for name, dtype in named_dtypes if dtype not in FLOAT_DTYPES]
    if bad and not _is_identity(compressor):
        listing = ", ".join(f"{name}: {dtype}" for name, dtype in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise TypeError(
            f"{compressor!r} compresses float32, float16 and bfloat16 gradients only; these parameters have "
            f"other dtypes: {listing}. Convert the model (model.float()) or leave those parameters out."
        )


def _is_identity(compressor: Compressor) -> bool:
    from gradcomp.compressors.casts import Identity

    return type(compressor) is Identity


def check_schedule(schedule, warmup_steps: Optional[int]):
    """``schedule``, or the default :class:`gradcomp.schedule.DenseWarmup` of ``warmup_steps``
    (default :data:`DEFAULT_WARMUP_STEPS`); one of the two, not both."""
    if schedule is not None and warmup_steps is not None:
        raise ValueError("pass warmup_steps or a schedule, not both (a schedule has its own dense steps)")
    if schedule is None:
        from gradcomp.schedule import DenseWarmup

        return DenseWarmup(check_count("warmup_steps", DEFAULT_WARMUP_STEPS if warmup_steps is None else warmup_steps))
    if not callable(getattr(schedule, "compressor_at", None)):
        raise TypeError(f"schedule must have compressor_at(step, base), got {type(schedule).__name__}")
    return schedule


def check_transform(transform):
    """``transform`` (or ``None``) if it has every method the engine calls."""
    if transform is not None:
        missing = [m for m in TRANSFORM_METHODS if not callable(getattr(transform, m, None))]
        if missing:
            raise TypeError(f"transform {type(transform).__name__} lacks {missing}")
    return transform


def loss_scale(grad_scaler) -> float:
    """A ``torch.amp.GradScaler``'s current scale (1.0 for ``None`` or a disabled one); a positive
    finite float, else ``RuntimeError``. On a GPU reading it is one device sync."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 1.0
    scale = float(grad_scaler.get_scale())
    if not (scale > 0 and scale != float("inf")):
        raise RuntimeError(f"the grad scaler's scale is {scale}; it must be a positive finite number")
    return scale
