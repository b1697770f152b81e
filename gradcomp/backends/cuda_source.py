"""The CUDA kernels' source and its compilation by NVRTC: what the ``cuda`` backend loads.

No CuPy at import and no GPU needed (NVRTC alone), so the tests check here that the exact source
compiles, with the exact options, where no GPU exists; :mod:`gradcomp.backends.cuda_ops` loads the
image on a device.
"""
from __future__ import annotations

import os
import re
from typing import Iterable, Tuple

import gradcomp.csrc

SOURCE_DIR = os.path.dirname(os.path.abspath(gradcomp.csrc.__file__))
#: Kernel sources compiled into one module, in this order.
SOURCE_FILES = ("twobit.cu", "twobit_chunk.cu", "threebit.cu", "topk.cu", "compact.cu")
#: Options for NVRTC. The kernels must match the torch reference bit for bit, so IEEE arithmetic
#: throughout: denormals kept (CuPy's own compile path always adds ``-ftz=true``, which flushes
#: them -- on an H200 a denormal in ``out`` then vanished in 2-bit decoding -- so
#: :func:`compile_image` calls NVRTC itself), no ``a * b + c`` contracted into one rounding, and
#: IEEE division and square root.
NVRTC_OPTIONS = ("-std=c++17", "-ftz=false", "-fmad=false", "-prec-div=true", "-prec-sqrt=true")

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


def kernel_source(source_dir: str = SOURCE_DIR, files: Iterable[str] = SOURCE_FILES) -> str:
    """One translation unit: :data:`SOURCE_FILES` with their local ``#include "..."`` inlined.

    Inlining (each header once) needs no include path for NVRTC.
    """
    seen = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        with open(os.path.join(source_dir, name), encoding="utf-8") as handle:
            text = handle.read()
        return _LOCAL_INCLUDE.sub(lambda match: expand(match.group(1)), text)

    return "\n".join(f"// ---- {name}\n{expand(name)}" for name in files)


def compile_image(capability: int, ptx: bool = False) -> Tuple[bytes, str]:
    """:func:`kernel_source` compiled by NVRTC with :data:`NVRTC_OPTIONS` for compute capability
    ``capability`` (90 for an H100): ``(image, "cubin")``, machine code, where this NVRTC knows
    the architecture and ``ptx`` is false, else ``(image, "ptx")`` for the newest one it knows at
    or below it (the driver compiles that). Needs NVRTC, not a GPU."""
    from cupy_backends.cuda.libs import nvrtc

    known = [int(arch) for arch in nvrtc.getSupportedArchs()]
    below = [arch for arch in known if arch <= capability]
    if not below:
        raise RuntimeError(f"this NVRTC targets compute capabilities {known}, none at or below {capability}")
    kind = "cubin" if capability in known and not ptx else "ptx"
    target = f"--gpu-architecture={'sm' if kind == 'cubin' else 'compute'}_{max(below)}"
    program = nvrtc.createProgram(kernel_source(), "gradcomp.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, [*NVRTC_OPTIONS, target])
        except nvrtc.NVRTCError as error:
            raise RuntimeError(f"NVRTC ({target}): {error}\n{nvrtc.getProgramLog(program)}") from error
        return (nvrtc.getCUBIN(program) if kind == "cubin" else nvrtc.getPTX(program)), kind
    finally:
        nvrtc.destroyProgram(program)
