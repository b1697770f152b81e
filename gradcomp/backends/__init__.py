"""Kernel backends and the one registry that maps ``(op, backend)`` to a function.

The ops and their contracts are defined once, in :data:`OPS`. Every backend implements
the same signature; ``torch`` is the reference every other backend is tested against.

=======================  ===========================================================
op                       signature (all tensors 1-D and contiguous)
=======================  ===========================================================
``twobit_compress``      ``(grad, residual_in, residual_out, threshold, codes)``
``twobit_decompress_add````(codes, threshold, out)``
``twobit_chunk_compress````(grad, residual_in, residual_out, codes, scales)``
``twobit_chunk_decompress_add`` ``(codes, scales, out)``
``threebit_compress``    ``(grad, residual_in, residual_out, codes, scales)``
``threebit_decompress_add`` ``(codes, scales, out)``
``topk_compress``        ``(grad, residual_in, residual_out, values, indices)``
``topk_decompress_add``  ``(values, indices, out)``
=======================  ===========================================================

The four chunk-scaled quantizer ops (:data:`PART_OPS`) also run over every parameter of a group in
one call, :func:`kernel_parts` (signatures in :mod:`gradcomp.backends.parts`), as does each quantizer's
average of every rank's payload (``threebit_average``, ``twobit_chunk_average``).

Shared conventions:

* ``grad`` is float32, float16 or bfloat16 with ``n`` elements. The compensated value is
  ``acc = float32(grad) + residual_in`` (``residual_in`` may be ``None``: no feedback).
* ``residual_in`` / ``residual_out`` are float32 ``[n]``; ``residual_out`` may be ``None``
  (nothing written) and may alias ``residual_in`` (in-place update). It receives
  ``acc - decompress(payload)`` element by element.
* ``out`` is float32 ``[n]`` and is accumulated into: ``out[i] = out[i] + decoded[i]``.

2-bit (MXNet threshold quantization). Element ``i`` lives in ``codes[i // 16]`` (int32)
at bits ``2 * (i % 16)`` and ``2 * (i % 16) + 1``:

* ``0b01``: ``acc >= t`` (finite), decodes to ``+t``, residual ``acc - t``;
* ``0b10``: ``acc <= -t`` (finite), decodes to ``-t``, residual ``acc + t``;
* ``0b00``: otherwise, decodes to ``0``, residual ``acc``;
* ``0b11``: ``acc`` is NaN or infinite, decodes to NaN (so a non-finite gradient on any
  rank makes the average non-finite on every rank), residual ``acc``.

Unused bits of the last word are zero.

Chunk-scaled 2-bit (``twobit_chunk_*``): the same codes, with a magnitude per chunk of 64
elements (``scales`` float32 ``[ceil(n / 64)]``, four code words per chunk) taken from the chunk
itself, as Ternary Weight Networks choose theirs. For chunk ``c`` of ``L`` elements, with
``m_i = |acc_i|`` (0 for a non-finite ``acc_i``) and sums taken in float32 by the halving tree
``s[j] += s[j + h]``, ``h = 32, 16, ..., 1`` over 64 slots (zeros past ``L``)::

    tau   = (sum m_i / L) * 0.7f
    keep  = finite and m_i > tau
    alpha = (sum of m_i over keep) / count(keep)     (0 when nothing is kept)

and the codes are ``0b01`` (``keep``, ``acc > 0``: ``+alpha``), ``0b10`` (``keep``, ``acc < 0``:
``-alpha``), ``0b11`` (non-finite: NaN) or ``0b00`` (0); the residual is ``acc - decoded`` (``acc``
for codes ``0b00`` and ``0b11``). Decoding adds ``+alpha``, ``-alpha``, ``+0.0`` or NaN.

Chunk-scaled 3-bit (``threebit_*``): seven levels ``q * s``, ``q`` in ``[-3, 3]``, with a scale per
chunk of 128 elements (``scales`` float32 ``[ceil(n / 128)]``). Element ``i`` lives in
``codes[i // 10]`` (int32) at bits ``3 * (i % 10)`` to ``3 * (i % 10) + 2``; bits 30 and 31 of every
word, and the bits past element ``n - 1`` of the last word, are zero. For chunk ``c``, with
``m_i = |acc_i|`` (0 for a non-finite ``acc_i``), in float32::

    s      = (max m_i) / 3.0f
    q_i    = min(max(rint(acc_i / s), -3), 3)    (round half to even; 0 when s == 0)
    code_i = q_i + 3                             (7 when acc_i is not finite)
    decoded_i = float(code_i - 3) * s            (NaN for code 7)

and the residual is ``acc_i - decoded_i`` (``acc_i`` for code 7). A maximum, unlike a sum, is exact
in any order, so the backends agree without a prescribed reduction tree.

Top-k. ``k = values.numel()``. The selection is the ``k`` entries of largest ``|acc|``,
where magnitude is ordered by the bits of ``|acc|`` read as an unsigned integer (so NaN >
inf > every finite value, as in ``torch.topk``), ties broken towards the lower index.
Every NaN has the same magnitude, ``0x7FFFFFFF``, whatever its payload bits: those are
not portable across hardware, so NaNs tie and go by index. ``n == 0`` (then ``k == 0``)
is valid and writes nothing.

Where an entry is NaN, the NaN's payload bits in ``values`` and ``residual_out`` are
unspecified: backends agree on *which* entries are NaN, not on their bits. The
selected indices are written in ascending order (int32, or int64 when ``n >= 2**31``) and
``values[j] = acc[indices[j]]`` cast to the dtype of ``values``.

Untrusted input. Decoders read payloads that came from other processes, so every op of
every backend checks its arguments first (:mod:`gradcomp.backends.checks`: dtypes raise
``TypeError``; shapes and sizes -- residuals of ``n``, ``k`` indices for ``k`` values,
``k <= n``, ``ceil(n / 16)`` code words, ``ceil(n / 64)`` chunk scales, ``ceil(n / 10)`` 3-bit
words and ``ceil(n / 128)`` their scales -- raise ``ValueError``), before anything is written.
``topk_decompress_add`` also rejects indices that do not strictly increase
inside ``[0, n)`` (out of range, negative, duplicate or unsorted) with ``ValueError`` and
writes nothing; the numba and CUDA kernels check inside the kernel (``n`` is passed to
them) and the CUDA decoder also skips any index outside ``[0, n)`` by itself. Padding bits
of the last 2-bit code word are never decoded. Naming the sending rank is the job of
:mod:`gradcomp.validation`, which the engine runs on every received payload first.
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

from gradcomp.backends import parts

OPS = ("twobit_compress", "twobit_decompress_add", "twobit_chunk_compress", "twobit_chunk_decompress_add",
       "threebit_compress", "threebit_decompress_add", "topk_compress", "topk_decompress_add")
BACKENDS = ("torch", "numba", "cuda")
ENV_VAR = "GRADCOMP_BACKEND"

# Backends live in their own modules and are imported on first use, so that
# ``import gradcomp`` never needs numba or cupy.
_BACKEND_MODULES = {
    "torch": "gradcomp.backends.torch_ops",
    "numba": "gradcomp.backends.numba",
    "cuda": "gradcomp.backends.cuda_ops",
}
_INSTALL_HINT = {
    "numba": "pip install 'numba>=0.60' (or: pip install gradcomp[numba])",
    "cuda": "pip install cupy-cuda12x (or: pip install gradcomp[cuda]) on a machine with a CUDA GPU",
}

KERNELS: Dict[Tuple[str, str], Callable] = {}
_import_errors: Dict[str, BaseException] = {}

logger = logging.getLogger(__name__)
# (device type, backend) pairs already logged: resolution runs on every op, the log line
# once per pair.
_logged_choices = set()
_logged_lock = threading.Lock()


def _log_choice(device: torch.device, backend: str, how: str) -> None:
    key = (device.type, backend)
    if key in _logged_choices:
        return
    with _logged_lock:
        if key in _logged_choices:
            return
        _logged_choices.add(key)
    logger.info("gradcomp kernels for %s tensors: backend %r (%s)", device.type, backend, how)


def implements(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is the implementation of ``op`` on ``backend`` (an entry of :data:`KERNELS`)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    return _register(op, backend)


def _load(backend: str) -> bool:
    """Import a backend module once; remember why it failed if it did."""
    if backend in _import_errors:
        return False
    if any(b == backend for (_, b) in KERNELS):
        return True
    try:
        importlib.import_module(_BACKEND_MODULES[backend])
    except ImportError as error:  # a missing optional dependency
        _import_errors[backend] = error
        return False
    return True


def is_available(backend: str, device: Optional[torch.device] = None) -> bool:
    """Whether ``backend`` can run on ``device`` here."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if device is not None:
        device = torch.device(device)
        if backend == "numba" and device.type != "cpu":
            return False
        if backend == "cuda" and device.type != "cuda":
            return False
    return _load(backend)


def resolve_backend(device, backend: Optional[str] = None) -> str:
    """The backend to use on ``device``: ``backend`` if given, else ``$GRADCOMP_BACKEND``,
    else the fastest available one (``cuda`` on CUDA devices, ``numba`` on CPU, ``torch``).

    An explicitly requested backend that cannot run raises ``RuntimeError`` saying why.
    """
    device = torch.device(device)
    requested = backend or os.environ.get(ENV_VAR) or None
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"unknown backend {requested!r} (argument or ${ENV_VAR}); choose one of {BACKENDS}")
        if requested == "numba" and device.type != "cpu":
            raise RuntimeError(f"backend 'numba' runs on CPU tensors only, got a tensor on {device}")
        if requested == "cuda" and device.type != "cuda":
            raise RuntimeError(f"backend 'cuda' runs on CUDA tensors only, got a tensor on {device}")
        if not _load(requested):
            raise RuntimeError(
                f"backend {requested!r} was requested but cannot be imported "
                f"({_import_errors[requested]}). Install it with: {_INSTALL_HINT[requested]}"
            )
        _log_choice(device, requested, "requested" if backend else f"${ENV_VAR}")
        return requested
    preferred = "cuda" if device.type == "cuda" else "numba" if device.type == "cpu" else "torch"
    if _load(preferred):
        _log_choice(device, preferred, "automatic")
        return preferred
    _load("torch")
    _log_choice(device, "torch", f"automatic; {preferred!r} is not available: {_import_errors.get(preferred)}")
    return "torch"


#: The ops with a batched form over the parts of one flat group (:mod:`gradcomp.backends.parts`).
#: An ``*_average`` op has no per-part op of its own: its looped form runs the family's ``*_decompress_add``.
PART_OPS = ("twobit_chunk_compress", "twobit_chunk_decompress_add", "twobit_chunk_average", "threebit_compress",
            "threebit_decompress_add", "threebit_average", "topk_compress")


def implements_parts(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is ``backend``'s batched form of ``op`` over parts (:func:`kernel_parts`), kept in
    :data:`KERNELS` under ``(op + "/parts", backend)``."""
    if op not in PART_OPS:
        raise ValueError(f"op {op!r} has no batched form; those are {PART_OPS}")
    return _register(f"{op}/parts", backend)


#: Optional faster forms, by family: ops whose torch form is their caller's own code (it runs wherever the resolved
#: backend registered none), and a backend may register one that writes and reads exactly the same bits
#: (:func:`implements_form`, :func:`form_kernel`).
#:
#: * ``"sparse_parts"``: compact top-k over every part of a group, the methods of
#:   :class:`~gradcomp.backends.sparse_parts.CompactParts` (``compact_encode``, ``compact_entries``).
#: * ``"check"``: the received payload's check over every part of a group, ``parts_valid``
#:   (:func:`gradcomp.backends.parts.parts_valid`; it accepts exactly what the torch form accepts).
#: * ``"elementwise"``: passes torch would run as several. ``divide_multiply``: ``fn(out, count, multiplier)``,
#:   float32 ``out[n]`` becomes ``out / count * multiplier`` (``count`` an int, ``multiplier`` float32 ``[n]``): an
#:   average back in a stage's units (:func:`~gradcomp.exchanges.base.average_gathered`). ``quotient_norms``:
#:   ``fn(grads, denoms)``, lists of ``k`` alike tensors (read only), returns ``(||g_t / d_t||, ||g_t||)`` as two
#:   float32 ``[k]`` tensors, bitwise ``torch._foreach_norm`` of the quotients and of the gradients, stacked, or
#:   ``None`` where it cannot promise those bits (:func:`~gradcomp.optim.step_norms.step_norms`). ``frozen_step``:
#:   ``fn(params, exp_avgs, grads, denoms, factor, weight, copy, decay, values)``, the frozen-variance Adam step of a
#:   param group (:func:`~gradcomp.optim.frozen_update.frozen_update`'s torch ops: ``grads * factor`` where ``factor``
#:   is a 0-d tensor, the moments ``lerp_`` by ``weight`` or a copy, ``params * decay`` where it is a float, then
#:   ``addcdiv_`` by ``values``), params and moments mutated; returns ``False`` with nothing written where it cannot
#:   promise torch's bits. ``caught_up_step``: ``fn(params, exp_avgs, grads, denoms, waits, shares, factor, weight,
#:   decay, values)``, the same step of parameters whose coordinates wait under a sparsifier
#:   (:func:`~gradcomp.optim.frozen_update.caught_up_update`'s torch ops: the int16 ``waits`` advanced, ``c`` read
#:   from ``shares`` at each wait, ``grads * c`` into the moments, the rest ``grads * (1 - c)`` onto the parameters,
#:   each wait zeroed where its gradient is nonzero), params, moments and waits mutated, ``False`` as above.
FORMS = {
    "sparse_parts": ("compact_encode", "compact_entries"),
    "check": ("parts_valid",),
    "elementwise": ("divide_multiply", "quotient_norms", "frozen_step", "caught_up_step"),
}


def _form_key(family: str, op: str) -> str:
    if op not in FORMS.get(family, ()):
        raise ValueError(f"unknown {family!r} form {op!r}; the optional forms are {FORMS}")
    return f"{op}/{family}"


def implements_form(family: str, op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` is ``backend``'s form of ``op`` of ``family`` (:data:`FORMS`), kept in :data:`KERNELS`
    under ``(op + "/" + family, backend)``."""
    return _register(_form_key(family, op), backend)


def form_kernel(family: str, op: str, device, backend: Optional[str] = None) -> Optional[Callable]:
    """The resolved backend's form of ``op`` of ``family`` (:data:`FORMS`), or ``None``: then the caller's torch
    form runs."""
    return KERNELS.get((_form_key(family, op), resolve_backend(device, backend)))


def _register(key: str, backend: str) -> Callable[[Callable], Callable]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends are {BACKENDS}")

    def decorate(fn: Callable) -> Callable:
        KERNELS[(key, backend)] = fn
        return fn

    return decorate


def kernel_parts(op: str, device, backend: Optional[str] = None) -> Callable:
    """``op`` over the parts of one flat group in one call (signatures in :mod:`gradcomp.backends.parts`):
    the backend's batched form where it has one, else a loop over :func:`kernel`'s op, part by part. Both
    write bitwise what the op would, part by part."""
    if op not in PART_OPS:
        raise ValueError(f"op {op!r} has no batched form; those are {PART_OPS}")
    chosen = resolve_backend(device, backend)
    batched = KERNELS.get((f"{op}/parts", chosen))
    if batched is not None:
        return batched
    return parts.looped(op, kernel(op.replace("_average", "_decompress_add"), device, chosen))


def kernel(op: str, device, backend: Optional[str] = None) -> Callable:
    """The implementation of ``op`` for tensors on ``device`` (see :func:`resolve_backend`)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {OPS}")
    chosen = resolve_backend(device, backend)
    try:
        return KERNELS[(op, chosen)]
    except KeyError:
        raise NotImplementedError(f"op {op!r} has no {chosen!r} implementation") from None
