"""The compressor protocol shared by every compressor."""
from __future__ import annotations

from typing import ClassVar, Optional

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


class Compressor:
    """Stateless, communication-free compression of one flat tensor.

    Subclasses define :meth:`layout`, :meth:`compress` and :meth:`decompress_add`.
    ``summable`` says whether payloads may be summed by an allreduce (then the payload
    has one segment, ``"data"``); otherwise they are allgathered and decoded one by one.
    """

    summable: ClassVar[bool] = False
    #: Whether error feedback applies (a lossless or cast-only payload needs none).
    uses_error_feedback: ClassVar[bool] = False

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        """The payload layout for a ``[numel]`` tensor of ``dtype``; depends on nothing else."""
        raise NotImplementedError

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
        raise NotImplementedError

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        """``out += decompress(payload)``; ``out`` is float32 ``[n]`` and is mutated."""
        raise NotImplementedError

    def check_payload(self, payload: Payload, numel: int) -> None:
        """Raise ``ValueError`` with the reason unless ``payload`` is well formed for ``[numel]``.

        Reads the payload, writes nothing. The default checks the layout (segments, dtypes,
        sizes) and the buffer size; compressors whose payload carries indices or codes also
        check their contents. Called through :func:`gradcomp.validation.validate_payload`.
        """
        from gradcomp.validation import check_layout

        check_layout(self, payload, numel)

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
