"""Baselines whose payloads can be summed by an allreduce: dense and fp16/bf16 casts."""
from __future__ import annotations

from typing import Optional

import torch

from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.registry import spec_name
from gradcomp.payload import Payload, PayloadLayout


class Cast(Compressor):
    """Send the tensor cast to ``wire_dtype`` (``None``: its own dtype). One segment, ``data``.

    Casting needs no error feedback to converge in practice (torch's fp16 hook and
    Horovod's fp16 compression keep none); ``residual_out`` still receives the cast error
    when asked, so the error-feedback identity holds for every compressor.
    """

    summable = True
    wire_dtype: Optional[torch.dtype] = None

    def layout(self, numel: int, dtype: torch.dtype) -> PayloadLayout:
        return PayloadLayout((("data", self.wire_dtype or dtype, numel),))

    def compress(self, tensor, residual=None, residual_out=None, backend: Optional[str] = None) -> Payload:
        check_gradient(tensor)
        payload = self.layout(tensor.numel(), tensor.dtype).allocate(tensor.device)
        data = payload["data"]
        if residual is None:
            data.copy_(tensor)
            if residual_out is not None:
                residual_out.copy_(tensor.float() - data.float())
        else:
            acc = tensor.float() + residual
            data.copy_(acc)
            if residual_out is not None:
                residual_out.copy_(acc - data.float())
        return payload

    def decompress_add(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> None:
        out.add_(payload["data"].float())

    def decompress(self, payload: Payload, out: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        # One conversion pass, as torch's fp16 hook writes its average back (zeroing and adding a float32 copy took
        # three passes and a buffer); the same values, but a -0.0 stays -0.0 where 0.0 + -0.0 is 0.0.
        return out.copy_(payload["data"])


@spec_name("identity")
class Identity(Cast):
    """Dense: the payload is the tensor itself, in its own dtype."""


@spec_name("fp16")
class FP16(Cast):
    """Cast to float16 on the wire (as torch's ``fp16_compress_hook``)."""

    wire_dtype = torch.float16


@spec_name("bf16")
class BF16(Cast):
    """Cast to bfloat16 on the wire (as torch's ``bf16_compress_hook``)."""

    wire_dtype = torch.bfloat16
