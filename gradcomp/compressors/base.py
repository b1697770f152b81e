"""The compressor protocol shared by every compressor."""
from __future__ import annotations

import abc
from typing import ClassVar, Optional, Tuple

import torch

from gradcomp.payload import Payload, PayloadLayout

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_gradient(tensor: torch.Tensor) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``tensor`` is a flat contiguous float tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"gradients must be float32, float16 or bfloat16, got {tensor.dtype}; "
            "integer and float64 tensors cannot be compressed"
        )
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"expected a flat contiguous tensor, got shape {tuple(tensor.shape)}; pass tensor.view(-1)")


class Compressor(abc.ABC):
    """Stateless, communication-free compression of one flat tensor (abstract base class).

    The contract every compressor keeps (the engine, both integrations and the payload
    validation rely on it):

    1. **No state, no communication.** A compressor holds only its settings; error feedback
       (:class:`gradcomp.error_feedback.ErrorFeedback`), schedules and exchanges live elsewhere. Two
       compressors with equal settings behave identically on every rank.
    2. **Fixed-size payloads.** :meth:`layout` depends only on ``(numel, dtype)`` and the
       settings, never on the data, so every rank sends the same number of bytes and
       payloads can be allgathered with no size exchange.
    3. **Fused error feedback.** :meth:`compress` computes ``acc = float32(tensor) + residual``,
       writes the payload of ``acc`` and, if asked, ``residual_out = acc - decompress(payload)``,
       in one pass; it never mutates ``tensor``.
    4. **Deterministic decoding.** :meth:`decompress_add` adds the decoded payload into a
       float32 ``out`` and touches nothing else, so summing the payloads of ranks ``0..P-1`` in
       order gives bitwise the same average on every rank.
    5. **Untrusted payloads are checked first.** :meth:`check_payload` raises ``ValueError``
       for a payload this compressor could not have produced for ``numel`` elements, reading
       only; :mod:`gradcomp.validation` calls it before any payload is decoded.
    6. **Summable payloads.** ``summable = True`` means payloads may be summed by an allreduce:
       the payload has exactly one segment, ``"data"``, and ``decompress(sum of payloads) ==
       sum of decompress(payload)`` up to rounding. Such compressors go through
       :meth:`compress`/:meth:`decompress` like every other (the engine never reads their dtype).
    7. ``uses_error_feedback`` says whether residuals apply (casts need none).
    8. A registered compressor has a ``spec`` string (:mod:`gradcomp.compressors.registry`)
       that rebuilds it with ``from_spec``; checkpoints and the cross-rank settings check use it.

    Subclasses define :meth:`layout`, :meth:`compress` and :meth:`decompress_add`, and
    override :meth:`check_payload` when their payload carries indices or codes.
    """

    summable: ClassVar[bool] = False
    #: Whether error feedback applies (a lossless or cast-only payload needs none).
    uses_error_feedback: ClassVar[bool] = False
    #: Whether a payload sends some entries whole and the rest not at all (top-k), so that
    #: :meth:`sent_indices` names them; quantizers send every entry approximately.
    sparsifies: ClassVar[bool] = False
    #: ``(compress op, decompress_add op, average op)`` with a batched form over a group's parts
    #: (:mod:`gradcomp.backends.parts`), for a payload that is ``codes`` then ``scales``; ``None`` if none.
    part_ops: Optional[Tuple[str, str, str]] = None
    #: :meth:`compress` takes ``divisor=`` (float32 ``[n]``): it compresses ``acc = float32(tensor) / divisor +
    #: residual``, bitwise the payload of ``tensor`` divided first, without the divided copy (Adam's stage exchanges
    #: its update units so: :attr:`gradcomp.exchanges.base.Handle.divisor`).
    divides: bool = False
    #: It averages every rank's payload of a group in one call (``average``), each element written once, bitwise
    #: the rank-by-rank decode of :func:`~gradcomp.exchanges.base.average_gathered`.
    averages: bool = False

    @abc.abstractmethod
    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        """The payload layout for a ``[numel]`` tensor of ``dtype``; depends on nothing else."""

    @abc.abstractmethod
    def compress(
        self,
        tensor: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
        residual_out: Optional[torch.Tensor] = None,
        backend: Optional[str] = None,
    ) -> Payload:
        """Compress ``acc = tensor + residual`` in one fused pass.

        Args:
            tensor: ``[n]`` float32/float16/bfloat16, not mutated.
            residual: ``[n]`` float32 error-feedback memory, or ``None``.
            residual_out: ``[n]`` float32 that receives ``acc - decompress(payload)``;
                may be ``residual`` itself (in-place) or ``None`` (not computed).
            backend: kernel backend override (see :mod:`gradcomp.backends`).
        Returns:
            a new :class:`Payload` of :meth:`layout` ``(n, tensor.dtype)``.
        """

    @abc.abstractmethod
    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        """``out += decompress(payload)``; ``out`` is float32 ``[n]`` and is mutated."""

    def check_payload(self, payload: Payload, numel: int):
        """Raise ``ValueError`` with the reason unless ``payload`` is well formed for ``[numel]``.

        Reads the payload, writes nothing. The default checks the layout (segments, dtypes,
        sizes) and the buffer size; compressors whose payload carries indices or codes also
        check their contents. Called through :func:`gradcomp.validation.validate_payload`.
        Returns ``None``, or what the check decoded on the way, which
        :func:`~gradcomp.exchanges.average_gathered` then hands to :meth:`add_checked` in place of
        decoding the same bytes again.
        """
        from gradcomp.validation import check_layout

        check_layout(self, payload, numel)

    def add_checked(self, payload: Payload, checked, out: torch.Tensor, backend: Optional[str] = None) -> None:
        """``out += decompress(payload)`` given ``checked``, what :meth:`check_payload` returned for ``payload``
        (not ``None``); ``out`` float32 ``[n]`` is mutated. Only a compressor whose check returns something
        has it."""
        raise NotImplementedError(f"{type(self).__name__}.check_payload returns nothing to decode from")

    def sent_indices(self, payload: Payload) -> Optional[torch.Tensor]:
        """The positions a sparsifying payload sends whole (an integer tensor), else ``None``."""
        return None

    def unwrapped(self) -> "Compressor":
        """The compressor this one applies to the elements it sends: itself, or for a wrapper that splits a
        group into parts (:class:`~gradcomp.compressors.per_parameter.PerParameter`), the parts' compressor."""
        return self

    def decompress(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        """Write ``decompress(payload)`` into ``out`` (any float dtype, ``[n]``) and return it."""
        if out.dtype == torch.float32:
            out.zero_()
            self.decompress_add(payload, out, backend)
            return out
        staging = torch.zeros(out.numel(), dtype=torch.float32, device=out.device)
        self.decompress_add(payload, staging, backend)
        return out.copy_(staging)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
