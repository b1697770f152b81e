"""The ``cuda`` backend: the kernels of ``csrc/`` (compiled by :mod:`gradcomp.backends.cuda_source`) run through CuPy.

Contracts are in :mod:`gradcomp.backends`. Each op is a short, fixed sequence of kernel
launches on ``torch.cuda.current_stream()``, with no host synchronisation except the one
that top-k decoding needs to report a bad payload:

* ``twobit_compress``: one kernel (compensate, quantise, pack, residual) -- one pass.
* ``twobit_decompress_add``: one kernel.
* ``topk_compress``: radix select in 3 passes of histogram + select, then a count and an
  ordered write of values, indices and residual (see ``csrc/topk.cu``).
* ``topk_decompress_add``: a check of the indices, then the decoder, which writes nothing
  unless every index lies in ``[0, n)`` strictly increasing; then one read of the check's
  counter back to the host (the only synchronisation of these ops), which raises
  ``ValueError`` for a bad payload.
* ``compact_encode`` and ``compact_entries`` (compact top-k over a group's parts,
  :data:`~gradcomp.backends.FORMS`' ``"sparse_parts"``): the plans of :mod:`gradcomp.backends.cuda_compact`,
  two launches to encode, three to check and one read of the check's verdict.

The launch plans are plain functions of a ``launch(name, grid, block, args)`` callable and a
:class:`~gradcomp.backends.cuda_launch.LaunchConfig`, so the tests run the very same plans against a CPU
emulation of the kernels (``tests/emulation``), with tiny blocks and grids, where no GPU exists.

Tensors stay torch tensors: kernels receive their ``data_ptr()`` (zero-copy, like DLPack
but without building a CuPy array per call), scratch comes from torch's caching allocator
(so CuPy's memory pool never holds GPU memory beside torch's), and launches go on torch's
current stream, so ordering with the surrounding torch work is what torch already ensures.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Tuple

import cupy  # ImportError here marks the backend unavailable (gradcomp.backends._load)
import numpy
import torch

from gradcomp.backends import checks, implements, implements_form
from gradcomp.backends.cuda_compact import plan_compact_encode, plan_compact_entries
from gradcomp.backends.cuda_launch import MAX_THREADS, Launch, LaunchConfig, pointer
from gradcomp.backends.cuda_source import compile_image

logger = logging.getLogger(__name__)

_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_INDEX_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
# Radix-select passes over the 31-bit magnitude key: (shift, bits), most significant first.
TOPK_PASSES = ((20, 11), (10, 10), (0, 10))
_TOPK_HISTOGRAM_BINS = sum(1 << bits for _, bits in TOPK_PASSES)
_TOPK_STATE = 2  # prefix (the threshold key once done), how many ties are still needed


# --- launch plans (shared by the GPU and the CPU emulation) ----------------------------


def plan_twobit_compress(launch: Launch, config: LaunchConfig, grad, residual_in, residual_out, threshold, codes):
    n = checks.check_twobit_compress(grad, residual_in, residual_out, codes)
    if n == 0:
        return
    tiles = -(-n // (16 * config.threads))  # a block packs 16 * threads elements per tile
    launch(
        f"gradcomp_twobit_compress_{_DTYPE_SUFFIX[grad.dtype]}",
        min(tiles, config.max_blocks),
        config.threads,
        (pointer(grad), pointer(residual_in), pointer(residual_out), numpy.float32(threshold), pointer(codes),
         numpy.int64(n)),
    )


def plan_twobit_decompress_add(launch: Launch, config: LaunchConfig, codes, threshold, out):
    n = checks.check_twobit_decompress_add(codes, out)
    if n == 0:
        return
    launch(
        "gradcomp_twobit_decompress_add",
        config.blocks(n),
        config.threads,
        (pointer(codes), numpy.float32(threshold), pointer(out), numpy.int64(n)),
    )


def chunk_threads(config: LaunchConfig) -> int:
    """Threads per block of the chunk-scaled kernel: a multiple of its 64-element chunk."""
    return max(64, config.threads // 64 * 64)


def plan_twobit_chunk_compress(launch: Launch, config: LaunchConfig, grad, residual_in, residual_out, codes, scales):
    n = checks.check_twobit_chunk_compress(grad, residual_in, residual_out, codes, scales)
    if n == 0:
        return
    threads = chunk_threads(config)
    groups = -(-n // threads)  # a block takes threads / 64 chunks at a time
    launch(
        f"gradcomp_twobit_chunk_compress_{_DTYPE_SUFFIX[grad.dtype]}",
        min(groups, config.max_blocks),
        threads,
        (pointer(grad), pointer(residual_in), pointer(residual_out), pointer(codes), pointer(scales), numpy.int64(n)),
    )


def plan_twobit_chunk_decompress_add(launch: Launch, config: LaunchConfig, codes, scales, out):
    n = checks.check_twobit_chunk_decompress_add(codes, scales, out)
    if n == 0:
        return
    launch("gradcomp_twobit_chunk_decompress_add", config.blocks(n), config.threads,
           (pointer(codes), pointer(scales), pointer(out), numpy.int64(n)))


#: Threads per block of the 3-bit compress kernel: one per element of its 128-element chunk
#: (``csrc/threebit.cu``); a block takes 640 elements, 64 whole code words, at a time.
THREEBIT_THREADS = 128
THREEBIT_TILE = 640


def plan_threebit_compress(launch: Launch, config: LaunchConfig, grad, residual_in, residual_out, codes, scales):
    n = checks.check_threebit_compress(grad, residual_in, residual_out, codes, scales)
    if n == 0:
        return
    launch(f"gradcomp_threebit_compress_{_DTYPE_SUFFIX[grad.dtype]}", min(-(-n // THREEBIT_TILE), config.max_blocks),
           THREEBIT_THREADS, (pointer(grad), pointer(residual_in), pointer(residual_out), pointer(codes),
                              pointer(scales), numpy.int64(n)))


def plan_threebit_decompress_add(launch: Launch, config: LaunchConfig, codes, scales, out):
    n = checks.check_threebit_decompress_add(codes, scales, out)
    if n == 0:
        return
    launch("gradcomp_threebit_decompress_add", config.blocks(n), config.threads,
           (pointer(codes), pointer(scales), pointer(out), numpy.int64(n)))


def plan_topk_compress(launch: Launch, config: LaunchConfig, grad, residual_in, residual_out, values, indices):
    n, k = checks.check_topk_compress(grad, residual_in, residual_out, values, indices)
    checks.check_vector("topk_compress", "values", values, (grad.dtype,))  # the kernels store grad's type
    if n == 0:
        return
    suffix = _DTYPE_SUFFIX[grad.dtype]
    blocks = config.blocks(n)
    # One zeroed int64 scratch: histograms of every pass, the select state, per-block counts.
    scratch = torch.zeros(_TOPK_HISTOGRAM_BINS + _TOPK_STATE + 2 * blocks, dtype=torch.int64, device=grad.device)
    base = scratch.data_ptr()
    state = numpy.uint64(base + 8 * _TOPK_HISTOGRAM_BINS)
    block_above = numpy.uint64(base + 8 * (_TOPK_HISTOGRAM_BINS + _TOPK_STATE))
    block_ties = numpy.uint64(base + 8 * (_TOPK_HISTOGRAM_BINS + _TOPK_STATE + blocks))
    g, r_in, n64 = pointer(grad), pointer(residual_in), numpy.int64(n)
    if k == 0:
        # Nothing selected: a threshold above every 31-bit key, no ties needed.
        scratch[_TOPK_HISTOGRAM_BINS] = 1 << 31
    else:
        histogram = base
        for index, (shift, bits) in enumerate(TOPK_PASSES):
            launch(
                f"gradcomp_topk_histogram_{suffix}",
                config.blocks(n, config.histogram_blocks),
                config.threads,
                (g, r_in, n64, numpy.uint64(histogram), state, numpy.int32(shift), numpy.int32(bits),
                 numpy.int32(index)),
            )
            launch(
                "gradcomp_topk_select",
                1,
                config.threads,
                (numpy.uint64(histogram), numpy.int32(1 << bits), numpy.int32(shift), state, numpy.int64(k),
                 numpy.int32(index)),
            )
            histogram += 8 << bits
        launch(f"gradcomp_topk_count_{suffix}", blocks, config.threads, (g, r_in, n64, state, block_above, block_ties))
    launch(
        f"gradcomp_topk_write_{suffix}_{_INDEX_SUFFIX[indices.dtype]}",
        blocks,
        config.threads,
        (g, r_in, pointer(residual_out), n64, state, block_above, block_ties, pointer(values), pointer(indices)),
    )


def plan_topk_decompress_add(launch: Launch, config: LaunchConfig, values, indices, out):
    """``out += decode(values, indices)``; raises ``ValueError`` (having written nothing) when
    an index lies outside ``[0, n)`` or does not exceed the one before it."""
    n, k = checks.check_topk_decompress_add(values, indices, out)
    if k == 0:
        return
    index_suffix = _INDEX_SUFFIX[indices.dtype]
    bad = torch.zeros(1, dtype=torch.int64, device=out.device)  # positions that fail the check
    launch(
        f"gradcomp_topk_check_indices_{index_suffix}",
        config.blocks(k),
        config.threads,
        (pointer(indices), numpy.int64(k), numpy.int64(n), pointer(bad)),
    )
    launch(
        f"gradcomp_topk_decompress_add_{_DTYPE_SUFFIX[values.dtype]}_{index_suffix}",
        config.blocks(k),
        config.threads,
        (pointer(values), pointer(indices), pointer(out), numpy.int64(k), numpy.int64(n), pointer(bad)),
    )
    failed = int(bad.item())  # the one device-to-host read of any op
    if failed:
        problem = checks.topk_index_problem(indices, n) or f"{failed} indices failed the kernel's check"
        raise ValueError(f"topk_decompress_add: {problem}; nothing was written")


# --- the compiled module ----------------------------------------------------------------


class CupyLaunch:
    """A :data:`Launch` on CuPy for one device: kernels looked up by name once, then reused.

    Launches go on CuPy's current stream, which :func:`_run_on_device` sets to torch's.
    """

    def __init__(self, module: "cupy.cuda.function.Module"):
        self.module = module
        self.kernels: Dict[str, "cupy.cuda.function.Function"] = {}

    def __call__(self, name: str, grid: int, block: int, args: Tuple) -> None:
        kernel = self.kernels.get(name)
        if kernel is None:
            kernel = self.kernels[name] = self.module.get_function(name)
        kernel((grid,), (block,), args)


def compile_module(device_index: int) -> "cupy.cuda.function.Module":
    """The kernels compiled (:func:`compile_image`) and loaded for CUDA device ``device_index``."""
    image, _ = compile_image(int(cupy.cuda.Device(device_index).compute_capability))
    module = cupy.cuda.function.Module()
    module.load(image)
    return module


_launchers: Dict[int, CupyLaunch] = {}
_configs: Dict[int, LaunchConfig] = {}
_lock = threading.Lock()


def device_launcher(device_index: int) -> CupyLaunch:
    """The kernels compiled for CUDA device ``device_index``: once per device, then cached.

    Raises ``RuntimeError`` saying what to do when there is no usable CUDA device or the
    compilation fails.
    """
    launcher = _launchers.get(device_index)
    if launcher is not None:
        return launcher
    with _lock:
        launcher = _launchers.get(device_index)
        if launcher is None:
            try:
                with cupy.cuda.Device(device_index):
                    launcher = CupyLaunch(compile_module(device_index))
            except Exception as error:  # CUDARuntimeError, CompileException, OSError, ...
                raise RuntimeError(
                    f"gradcomp's cuda backend could not compile its kernels for CUDA device {device_index} "
                    f"({type(error).__name__}: {error}). It needs a CUDA GPU with a working driver and a CuPy "
                    f"built for that CUDA version (pip install cupy-cuda12x); without one, use "
                    f"backend='torch' or backend='numba' (or set GRADCOMP_BACKEND)."
                ) from error
            _launchers[device_index] = launcher
            logger.info("gradcomp: CUDA kernels compiled for device %d (%s)", device_index,
                        torch.cuda.get_device_name(device_index))
    return launcher


def device_config(device_index: int) -> LaunchConfig:
    """Launch sizes for a device: enough blocks to fill every SM several times over."""
    config = _configs.get(device_index)
    if config is None:
        sms = torch.cuda.get_device_properties(device_index).multi_processor_count
        config = _configs[device_index] = LaunchConfig(
            threads=MAX_THREADS, max_blocks=8 * sms, histogram_blocks=2 * sms
        )
    return config


_streams: Dict[Tuple[int, int], "cupy.cuda.Stream"] = {}


def _cupy_stream(device_index: int) -> "cupy.cuda.Stream":
    """torch's current stream on the device, as a CuPy stream (wrapped once per stream)."""
    stream = torch.cuda.current_stream(device_index)
    key = (device_index, stream.cuda_stream)
    wrapped = _streams.get(key)
    if wrapped is None:
        if hasattr(cupy.cuda.Stream, "from_external"):  # CuPy >= 14: the CUDA stream protocol
            wrapped = cupy.cuda.Stream.from_external(stream)
        else:
            wrapped = cupy.cuda.ExternalStream(stream.cuda_stream, device_index)
        _streams[key] = wrapped
    return wrapped


def _run_on_device(plan, tensors, *args):
    """Run ``plan(launch, config, *args)`` on the device of ``tensors``, on torch's stream; what it returns."""
    present = [t for t in tensors if t is not None]
    devices = {t.device for t in present}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise RuntimeError(
            "gradcomp's cuda backend needs every tensor on one CUDA device, got "
            f"{sorted(str(d) for d in devices)}; use backend='torch' or 'numba' for CPU tensors"
        )
    index = present[0].device.index
    if index is None:
        index = torch.cuda.current_device()
    launcher = device_launcher(index)
    with cupy.cuda.Device(index), _cupy_stream(index):
        return plan(launcher, device_config(index), *args)


@implements("twobit_compress", "cuda")
def twobit_compress(grad, residual_in, residual_out, threshold: float, codes) -> None:
    _run_on_device(plan_twobit_compress, (grad, residual_in, residual_out, codes),
                   grad, residual_in, residual_out, threshold, codes)


@implements("twobit_decompress_add", "cuda")
def twobit_decompress_add(codes, threshold: float, out) -> None:
    _run_on_device(plan_twobit_decompress_add, (codes, out), codes, threshold, out)


@implements("topk_compress", "cuda")
def topk_compress(grad, residual_in, residual_out, values, indices) -> None:
    _run_on_device(plan_topk_compress, (grad, residual_in, residual_out, values, indices),
                   grad, residual_in, residual_out, values, indices)


@implements("topk_decompress_add", "cuda")
def topk_decompress_add(values, indices, out) -> None:
    _run_on_device(plan_topk_decompress_add, (values, indices, out), values, indices, out)


@implements("twobit_chunk_compress", "cuda")
def twobit_chunk_compress(grad, residual_in, residual_out, codes, scales) -> None:
    _run_on_device(plan_twobit_chunk_compress, (grad, residual_in, residual_out, codes, scales),
                   grad, residual_in, residual_out, codes, scales)


@implements("twobit_chunk_decompress_add", "cuda")
def twobit_chunk_decompress_add(codes, scales, out) -> None:
    _run_on_device(plan_twobit_chunk_decompress_add, (codes, scales, out), codes, scales, out)


@implements("threebit_compress", "cuda")
def threebit_compress(grad, residual_in, residual_out, codes, scales) -> None:
    _run_on_device(plan_threebit_compress, (grad, residual_in, residual_out, codes, scales),
                   grad, residual_in, residual_out, codes, scales)


@implements("threebit_decompress_add", "cuda")
def threebit_decompress_add(codes, scales, out) -> None:
    _run_on_device(plan_threebit_decompress_add, (codes, scales, out), codes, scales, out)


@implements_form("sparse_parts", "compact_encode", "cuda")
def compact_encode(parts, values, indices, buffer, residual_out) -> bool:
    return _run_on_device(plan_compact_encode, (values, indices, buffer, residual_out),
                          parts, values, indices, buffer, residual_out)


@implements_form("sparse_parts", "compact_entries", "cuda")
def compact_entries(parts, buffer):
    return _run_on_device(plan_compact_entries, (buffer,), parts, buffer)
