"""Compressors: stateless, communication-free, one flat tensor in, one payload out.

Each compressor is also reachable by name through one registry
(:mod:`gradcomp.compressors.registry`): ``from_spec("topk:0.01")``, ``"twobit:0.5"``,
``"twobit:rms"``, ``"threebit"``, ``"fp16"``, ``"bf16"``, ``"identity"``; ``compressor.spec`` gives the
string back.
"""
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.casts import BF16, FP16, Cast, Identity
from gradcomp.compressors.registry import from_spec, registered, spec_name, spec_of
from gradcomp.compressors.threebit import ThreeBit
from gradcomp.compressors.topk import TopK
from gradcomp.compressors.twobit import TwoBit

__all__ = [
    "Compressor", "TopK", "TwoBit", "ThreeBit", "Identity", "FP16", "BF16", "Cast", "check_gradient",
    "from_spec", "registered", "spec_name", "spec_of",
]  # fmt: skip
