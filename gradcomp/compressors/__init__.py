"""Compressors: stateless, communication-free, one flat tensor in, one payload out."""
from gradcomp.compressors.base import Compressor, check_gradient
from gradcomp.compressors.casts import BF16, FP16, Cast, Identity
from gradcomp.compressors.topk import TopK
from gradcomp.compressors.twobit import TwoBit

__all__ = ["Compressor", "TopK", "TwoBit", "Identity", "FP16", "BF16", "Cast", "check_gradient"]
