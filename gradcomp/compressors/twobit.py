"""2-bit quantization, 16 codes to a 32-bit word: MXNet's threshold, or levels from each chunk's statistics."""
from __future__ import annotations

import math
from typing import Optional

import torch

from gradcomp.backends import kernel
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.registry import spec_name
from gradcomp.payload import Payload, PayloadLayout
from gradcomp.validation import check_chunk_scales, check_layout

#: Elements per piece of :func:`_sum_of_squares` on a CPU: float64 copies of 512 KB, where one of the whole
#: tensor (32 MB at 2^22 elements, most of its time in fresh pages) took 20.0 ms against 3.45 ms piece by piece
#: (one thread, medians of 21 interleaved repeats, quiet, load 0.47, a 2-core VM).
SQUARES_CHUNK = 1 << 16


def _sum_of_squares(tensor: torch.Tensor, residual: Optional[torch.Tensor]) -> float:
    """``sum((float32(tensor) + residual) ** 2)`` summed in float64 (``tensor``: ``[n]`` float32/16/bf16;
    ``residual``: float32 ``[n]`` or ``None``; neither is mutated). On a CPU piece by piece
    (:data:`SQUARES_CHUNK`), into one float64 on the device (one host read at the end); elsewhere in one
    reduction (one launch)."""
    if tensor.device.type != "cpu":
        acc = tensor.float() if residual is None else tensor.float() + residual
        return float(torch.linalg.vector_norm(acc, dtype=torch.float64)) ** 2
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, tensor.numel(), SQUARES_CHUNK):
        piece = tensor[start:start + SQUARES_CHUNK].float()
        if residual is not None:
            piece = piece + residual[start:start + SQUARES_CHUNK]
        wide = piece.double()
        total += torch.dot(wide, wide)
    return float(total)


@spec_name("twobit", params=("threshold",))
class TwoBit(Compressor):
    """``acc >= t`` sends ``+t``, ``acc <= -t`` sends ``-t``, anything else sends 0.

    Three ways to choose ``t``:

    * ``TwoBit(0.5)``: one fixed threshold for every tensor and step (MXNet's semantics).
      Payload: ``codes`` int32 ``[ceil(n / 16)]``; the bit layout is documented in
      :mod:`gradcomp.backends`.
    * ``TwoBit("rms")``: ``t`` is recomputed at every compression from the tensor being
      compressed, ``t = RMS(acc) = ||acc||_2 / sqrt(n)``, and shipped with the codes.
      Payload: ``codes`` as above, then ``scale`` float32 ``[1]`` (``t``); decoding reads
      ``t`` from the payload. As 1-bit SGD, EF-signSGD and 1-bit Adam scale theirs. A fixed
      threshold suits only gradients of one known magnitude: measured on charlm-small with
      ``4 x`` the warm-up RMS, only 0.54% of codes were non-zero and the residual norm grew
      to 15; with the per-step RMS 12% were non-zero and the residual norm stayed near 0.9.
      ``t`` is per compressed tensor: give each parameter its own compression call for a
      per-parameter scale (one scale per DDP bucket is a coarser algorithm).

    * ``TwoBit("chunk")`` (the recipe's choice): every chunk of 64 elements gets its own level
      from its own statistics, Ternary Weight Networks' rule: entries with ``|acc| > 0.7 *
      mean|acc|`` send ``+-alpha``, ``alpha`` the mean ``|acc|`` of those entries; the rest send 0.
      Payload: ``codes`` as above, then ``scales`` float32 ``[ceil(n / 64)]`` (1/16 more bytes).
      No level is fixed in advance, so a large coordinate is sent at its chunk's magnitude, not
      drained by ``t`` a step (why MXNet's and the ``"rms"`` threshold lag under momentum), and a
      small chunk still sends its own largest entries. Measured on charlm-small (AdamW, 600
      steps, 2 simulated ranks): ``"rms"`` ended 32% above the dense held-out loss, ``"chunk"``
      0.9% (``experiments/results/convergence/``).

    With error feedback the residual keeps ``acc - sent`` in every mode.
    """

    uses_error_feedback = True

    #: Elements per scale in the ``"chunk"`` mode.
    CHUNK = 64

    def __init__(self, threshold=0.5):
        word = threshold.strip().lower() if isinstance(threshold, str) else None
        #: ``True`` in the ``"chunk"`` mode (a level per 64 elements, sent in the payload).
        self.chunked = word == "chunk"
        #: ``True`` in the ``"rms"`` mode (threshold recomputed per tensor, sent in the payload).
        self.adaptive = word == "rms"
        if word in ("rms", "chunk"):
            self.threshold = word
            return
        if word is not None:
            raise ValueError(f"TwoBit(threshold={threshold!r}): a threshold is a positive number, 'rms' or 'chunk'")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(
                f"TwoBit(threshold=...) must be a positive number, 'rms' or 'chunk', got {type(threshold).__name__}"
            )
        if not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"TwoBit(threshold={threshold!r}): threshold must be finite and > 0")
        # Kernels compare in float32; store the float32 value so every backend agrees.
        self.threshold = float(torch.tensor(threshold, dtype=torch.float32))
        if self.threshold <= 0 or not math.isfinite(self.threshold):
            raise ValueError(f"TwoBit(threshold={threshold!r}) is not a positive finite float32")

    @property
    def part_ops(self):
        """The chunk mode's batched ops (its payload is ``codes`` then ``scales``); ``None`` otherwise."""
        if not self.chunked:
            return None
        return ("twobit_chunk_compress", "twobit_chunk_decompress_add", "twobit_chunk_average")

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        codes = ("codes", torch.int32, (numel + 15) // 16)
        if self.chunked:
            return PayloadLayout((codes, ("scales", torch.float32, (numel + self.CHUNK - 1) // self.CHUNK)))
        return PayloadLayout((codes, ("scale", torch.float32, 1)) if self.adaptive else (codes,))

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None) -> Payload:
        check_gradient(tensor)
        payload = self.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
        if self.chunked:
            op = kernel("twobit_chunk_compress", tensor.device, backend)
            op(tensor, residual, residual_out, payload["codes"], payload["scales"])
            return payload
        threshold = self._rms_threshold(tensor, residual, payload) if self.adaptive else self.threshold
        op = kernel("twobit_compress", tensor.device, backend)
        op(tensor, residual, residual_out, threshold, payload["codes"])
        return payload

    @staticmethod
    def _rms_threshold(tensor: torch.Tensor, residual: Optional[torch.Tensor], payload: Payload) -> float:
        """``t = RMS(tensor + residual)`` as a positive finite float32, also written to
        ``payload["scale"]``.

        The sum of squares is taken in float64, so it cannot overflow for finite float32
        entries. If ``acc`` holds NaN/Inf, ``t`` falls back to 1.0: those entries still get
        the non-finite code, decode as NaN and make the step's average non-finite, so the
        engine rejects the step as it does with a fixed threshold. An all-zero ``acc`` also
        gets 1.0 (every code 0). Reading ``t`` back to the host is one device sync per
        tensor on a GPU (the kernels take the threshold as a scalar argument).
        """
        rms = math.sqrt(_sum_of_squares(tensor, residual) / max(1, tensor.numel()))
        scale = payload["scale"]
        scale.fill_(rms if math.isfinite(rms) else 1.0)
        if not float(scale[0]) > 0:  # zero, or so small it rounds to zero in float32
            scale.fill_(1.0)
        return float(scale[0])

    def payload_threshold(self, payload: Payload) -> float:
        """The threshold a payload was encoded with: the fixed one, or its ``scale``."""
        return float(payload["scale"][0]) if self.adaptive else self.threshold

    def check_payload(self, payload: Payload, numel: int) -> None:
        """Raise ``ValueError`` unless the layout fits ``[numel]`` (``ceil(numel / 16)`` words,
        plus the scale in the ``"rms"`` mode), the unused bits of the last word are zero (the
        kernels always leave them so) and a shipped scale is a positive finite float32."""
        check_layout(self, payload, numel)
        used = numel % 16
        if used:
            last = int(payload["codes"][-1]) & 0xFFFFFFFF
            if last >> (2 * used):
                raise ValueError(
                    f"2-bit codes: the last word 0x{last:08x} has non-zero bits past element {numel - 1} "
                    f"(only its low {2 * used} bits are used for numel={numel})"
                )
        if self.adaptive:
            scale = float(payload["scale"][0])
            if not (math.isfinite(scale) and scale > 0):
                raise ValueError(f"2-bit scale must be a positive finite float32, got {scale!r}")
        if self.chunked:
            check_chunk_scales(payload["scales"], "2-bit chunk scales")

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        if self.chunked:
            kernel("twobit_chunk_decompress_add", out.device, backend)(payload["codes"], payload["scales"], out)
            return
        threshold = self.payload_threshold(payload)
        kernel("twobit_decompress_add", out.device, backend)(payload["codes"], threshold, out)

    def __repr__(self) -> str:
        return f"TwoBit(threshold={self.threshold!r})"
