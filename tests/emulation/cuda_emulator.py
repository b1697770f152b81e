"""Execute the CUDA kernels of ``csrc/`` on the CPU: build the emulation and launch kernels.

:func:`build` compiles every ``csrc/*.cu`` with g++ under ``cuda_emulation.h`` together with
``harness.cpp`` into a shared library, cached under a key that hashes every input.
:class:`EmulatedLauncher` loads it with ctypes and is a drop-in for the CuPy launcher of
:mod:`gradcomp.backends.cuda_ops`: ``launch(name, grid, block, args)`` with the same typed
NumPy scalars, so the host-side launch plan that runs on a GPU is the one tested here.
Tensors are CPU tensors; their ``data_ptr()`` stands for device memory.
"""
from __future__ import annotations

import collections
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

import numpy

EMULATION_DIR = Path(__file__).resolve().parent
HEADER = EMULATION_DIR / "cuda_emulation.h"
HARNESS = EMULATION_DIR / "harness.cpp"
CXX = os.environ.get("CXX", "g++")
# -O1 keeps the build to seconds; -ffp-contract=off keeps a*b+c from fusing (the GPU build
# contracts only what the kernels would write as a multiply-add, and they write none).
CXXFLAGS = ("-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
_KERNEL_MARKER = "GRADCOMP_EMULATED_GLOBAL"
_KERNEL_DECLARATION = re.compile(r'extern\s+"C"\s+' + _KERNEL_MARKER + r"\s+void\s+(\w+)\s*\(")

# The kinds and sizes the harness checks against each kernel's C++ signature.
_ARGUMENT_TYPES = {
    numpy.uint64: ("p", ctypes.c_uint64),  # device pointers (gradcomp.backends.cuda_ops packs them so)
    numpy.int64: ("i", ctypes.c_int64),
    numpy.int32: ("i", ctypes.c_int32),
    numpy.float32: ("f", ctypes.c_float),
}


class EmulationError(RuntimeError):
    """A launch the emulation refused or a kernel misbehaved (e.g. a divergent __syncthreads)."""


def cache_root() -> Path:
    """Where built libraries are kept: ``$GRADCOMP_EMULATION_CACHE`` or a per-user temp folder."""
    configured = os.environ.get("GRADCOMP_EMULATION_CACHE")
    if configured:
        return Path(configured)
    return Path(tempfile.gettempdir()) / f"gradcomp-cuda-emulation-{os.getuid()}"


def _sources(source_dir: Path) -> List[Path]:
    sources = sorted(source_dir.glob("*.cu"))
    if not sources:
        raise FileNotFoundError(f"no CUDA sources (*.cu) in {source_dir}")
    return sources


def _build_key(source_dir: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(source_dir.glob("*.cu")) + sorted(source_dir.glob("*.cuh")) + [HEADER, HARNESS]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join((CXX,) + CXXFLAGS).encode())
    return digest.hexdigest()[:20]


def _run(command: Sequence[str]) -> str:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulationError(f"{' '.join(command)} failed:\n{result.stderr[-6000:]}")
    return result.stdout


def kernel_names(source_dir: Path, work_dir: Path) -> List[str]:
    """The ``extern "C" __global__`` kernels of ``source_dir``, found after preprocessing (so
    kernels stamped out by macros count too)."""
    unit = work_dir / "sources.inc"
    preprocessed = _run(
        [CXX, "-std=c++20", "-E", "-P", f"-D__global__={_KERNEL_MARKER}", f"-I{EMULATION_DIR}", f"-I{source_dir}",
         "-include", str(HEADER), "-x", "c++", str(unit)]
    )
    return sorted(set(_KERNEL_DECLARATION.findall(preprocessed)))


def build(source_dir: Path, cache_dir: Optional[Path] = None) -> Path:
    """Compile the emulation library for ``source_dir`` (or reuse the cached one); its path."""
    source_dir = Path(source_dir).resolve()
    cache_dir = Path(cache_dir) if cache_dir is not None else cache_root()
    library = cache_dir / f"libgradcomp_emulation_{_build_key(source_dir)}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="build-", dir=cache_dir))
    try:
        (work_dir / "sources.inc").write_text(
            "".join(f'#include "{path.name}"\n' for path in _sources(source_dir))
        )
        names = kernel_names(source_dir, work_dir)
        if not names:
            raise EmulationError(f'no extern "C" __global__ kernels found in {source_dir}')
        (work_dir / "kernels.inc").write_text("".join(f"GRADCOMP_EMULATED_KERNEL({name})\n" for name in names))
        staged = work_dir / library.name
        _run(
            [CXX, *CXXFLAGS, f"-I{EMULATION_DIR}", f"-I{source_dir}",
             f'-DGRADCOMP_EMULATION_SOURCES="{work_dir / "sources.inc"}"',
             f'-DGRADCOMP_EMULATION_KERNELS="{work_dir / "kernels.inc"}"',
             str(HARNESS), "-o", str(staged)]
        )
        os.replace(staged, library)  # atomic: concurrent builders never see half a library
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    _prune(cache_dir, keep=library)
    return library


def _prune(cache_dir: Path, keep: Path, max_age_s: float = 7 * 24 * 3600) -> None:
    """Drop libraries of other source versions not rebuilt for a week."""
    now = time.time()
    for old in cache_dir.glob("libgradcomp_emulation_*.so"):
        try:
            if old != keep and now - old.stat().st_mtime > max_age_s:
                old.unlink()
        except OSError:  # another process pruned it first
            pass


class EmulatedLauncher:
    """``launch(name, grid, block, args)`` on the emulation; counts the launches it ran.

    ``args`` are NumPy scalars of the types in ``_ARGUMENT_TYPES`` (``numpy.uint64`` for
    pointers), exactly what :mod:`gradcomp.backends.cuda_ops` hands to CuPy.
    """

    def __init__(self, library: Path):
        self.library = ctypes.CDLL(str(library))
        self.library.gc_emu_launch.restype = ctypes.c_int
        self.library.gc_emu_launch.argtypes = [
            ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
        ]
        self.library.gc_emu_kernel_name.restype = ctypes.c_char_p
        self.library.gc_emu_kernel_name.argtypes = [ctypes.c_int]
        self.max_threads = int(self.library.gc_emu_max_threads())
        self.launches: collections.Counter = collections.Counter()
        self.log: List[tuple] = []

    @property
    def kernel_names(self) -> List[str]:
        return [self.library.gc_emu_kernel_name(i).decode() for i in range(self.library.gc_emu_kernel_count())]

    def __call__(self, name: str, grid: int, block: int, args: Iterable) -> None:
        args = tuple(args)
        kinds, sizes, values = [], [], []
        for position, arg in enumerate(args):
            try:
                kind, ctype = _ARGUMENT_TYPES[type(arg)]
            except KeyError:
                raise EmulationError(
                    f"{name}: argument {position} is a {type(arg).__name__}; kernel arguments must be "
                    f"numpy.uint64 (pointer), numpy.int64, numpy.int32 or numpy.float32, since CuPy packs "
                    f"a Python int as int64 and a Python float as double whatever the kernel takes"
                ) from None
            kinds.append(kind)
            sizes.append(ctypes.sizeof(ctype))
            values.append(ctype(arg.item()))
        addresses = [ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values]
        pointers = (ctypes.c_void_p * max(1, len(values)))(*addresses)
        error = ctypes.create_string_buffer(1024)
        status = self.library.gc_emu_launch(
            name.encode(), int(grid), int(block), pointers, "".join(kinds).encode(),
            (ctypes.c_int * max(1, len(sizes)))(*sizes), len(values), error, len(error),
        )
        if status != 0:
            raise EmulationError(error.value.decode())
        self.launches[name] += 1
        self.log.append((name, int(grid), int(block)))


def load_cuda_plans(module_name: str = "gradcomp_tests_cuda_ops_plans"):
    """``gradcomp/backends/cuda_ops.py`` as a private module, whatever is installed.

    The launch plans it holds need no CuPy, but the module imports CuPy at the top (that is
    how the registry learns the backend is unavailable). A stand-in ``cupy`` lets it load
    here; the registry is restored afterwards, so the stand-in never serves a real op.
    Loaded once per process (``sys.modules[module_name]``).
    """
    import importlib.util
    import sys
    import types

    import gradcomp.backends

    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    path = Path(gradcomp.backends.__file__).resolve().parent / "cuda_ops.py"
    saved_cupy = sys.modules.get("cupy")
    saved_kernels = dict(gradcomp.backends.KERNELS)
    sys.modules["cupy"] = types.ModuleType("cupy")
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses look their module up while being built
        spec.loader.exec_module(module)
        return module
    finally:
        if saved_cupy is None:
            del sys.modules["cupy"]
        else:
            sys.modules["cupy"] = saved_cupy
        gradcomp.backends.KERNELS.clear()
        gradcomp.backends.KERNELS.update(saved_kernels)
