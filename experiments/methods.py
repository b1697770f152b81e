"""How a gradient-communication method attaches to a DDP model in the experiments.

:func:`attach_method` installs a method of :mod:`experiments.catalog` (dense, torch's fp16 and
PowerSGD hooks, gradcomp's compressors and recipes, ``Auto``) on a DDP model and returns its
:class:`Telemetry` (bytes handed to collectives and time spent compressing, per step).
:func:`compressor_for` builds a method's compressor from the command line's settings;
:func:`choose_twobit_threshold` and :func:`warm_up_kernels` serve the runs that need them.
:func:`attach_study_method` installs the convergence study's methods (and the step-time benchmark's).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

from experiments.catalog import METHODS

__all__ = ["Telemetry", "attach_method", "compressor_for", "initial_twobit_threshold", "warm_up_kernels",
           "choose_twobit_threshold", "in_bucket_order", "GRADCOMP_WARMUP_STEPS", "AUTO_THRESHOLD_SCALE",
           "attach_study_method", "StudyTelemetry", "STUDY_DENSITY"]

GRADCOMP_WARMUP_STEPS = 2  # dense steps before compression starts (gradcomp and PowerSGD alike)
# --threshold auto: t = AUTO_THRESHOLD_SCALE x RMS of the averaged gradient of the last
# warm-up step (see choose_twobit_threshold).
AUTO_THRESHOLD_SCALE = 4.0


class Telemetry:
    """Per-step ``bytes_sent`` / ``dense_bytes`` / ``compress_s`` for any method.

    torch's hooks are wrapped to count bytes and time their synchronous part; gradcomp's
    hook reports through its own ``CompressionState.stats()``.
    """

    def __init__(self, dense_bytes: int):
        self.dense_bytes_per_step = dense_bytes
        self.gradcomp_state = None
        self._bytes = 0
        self._compress_s = 0.0
        self._fixed_bytes: Optional[int] = None  # for DDP's built-in allreduce (no hook)

    def wrap(self, hook: Callable, count_bytes: Callable) -> Callable:
        """``hook`` with a timer around its call and ``count_bytes(state, bucket)`` added up."""

        def timed_hook(state, bucket):
            nbytes = count_bytes(state, bucket)  # before the hook: it may rewrite the buffer
            started = time.perf_counter()
            future = hook(state, bucket)
            self._compress_s += time.perf_counter() - started
            self._bytes += nbytes(state, bucket) if callable(nbytes) else nbytes
            return future

        return timed_hook

    def end_step(self) -> dict:
        if self.gradcomp_state is not None:
            last = self.gradcomp_state.stats()["last_step"]
            return {
                "bytes_sent": last["bytes_sent"],
                "dense_bytes": last["dense_bytes"],
                "compress_s": last["compress_s"],
            }
        sent = self._fixed_bytes if self._fixed_bytes is not None else self._bytes
        out = {"bytes_sent": sent, "dense_bytes": self.dense_bytes_per_step, "compress_s": self._compress_s}
        self._bytes, self._compress_s = 0, 0.0
        return out


def _buffer_bytes(bucket) -> int:
    return bucket.buffer().numel() * bucket.buffer().element_size()


def _powersgd_bytes(state, bucket):
    """PowerSGD counts the elements it allreduces; read the counter's growth after the
    hook ran (warm-up steps do not count and send the whole buffer)."""
    before = state.total_numel_after_compression
    element_size = bucket.buffer().element_size()
    whole = _buffer_bytes(bucket)

    def after(state, bucket):
        grown = state.total_numel_after_compression - before
        return grown * element_size if grown else whole

    return after


def in_bucket_order(hook: Callable) -> Callable:
    """``hook``, run one bucket at a time.

    PowerSGD launches its second and third allreduce (of P and Q) from ``.then``
    callbacks, which run on whichever thread completes the previous one. With Gloo the
    buckets' collectives then interleave in a different order on different ranks and
    the job dies with a size mismatch ("op.preamble.length <= op.nbytes"). Waiting, in
    the hook itself (on the autograd thread, never inside a ``.then``), for the previous
    bucket's future before starting the next keeps the order identical on every rank.
    The cost: one bucket's PowerSGD pipeline no longer overlaps the next bucket's.
    """
    pending = [None]

    def ordered_hook(state, bucket):
        if pending[0] is not None:
            pending[0].wait()
        future = hook(state, bucket)
        pending[0] = None if bucket.is_last() else future
        return future

    return ordered_hook


def attach_method(model, method: str, args, dense_bytes: int, optimizer=None, scheduler=None):
    """Register ``method``'s comm hook on the DDP ``model``; return its :class:`Telemetry`.

    gradcomp's recipe methods take the run's ``optimizer`` and LR ``scheduler`` (the one-call
    recipe reads them, and may move SGD's momentum into gradcomp)."""
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    telemetry = Telemetry(dense_bytes)
    if method == "dense":
        telemetry._fixed_bytes = dense_bytes
    elif method == "noop":
        model.register_comm_hook(None, telemetry.wrap(debugging_hooks.noop_hook, lambda s, b: 0))
    elif method == "fp16":
        model.register_comm_hook(
            None, telemetry.wrap(default_hooks.fp16_compress_hook, lambda s, b: b.buffer().numel() * 2)
        )
    elif method == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=4,
            start_powerSGD_iter=GRADCOMP_WARMUP_STEPS,
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=args.seed,
        )
        model.register_comm_hook(state, in_bucket_order(telemetry.wrap(powersgd.powerSGD_hook, _powersgd_bytes)))
    elif method == "auto" or (method in METHODS and METHODS[method].compressor):
        from gradcomp.hooks import ddp as gradcomp_ddp
        from gradcomp.policy import Auto

        entry = METHODS[method]
        # Auto: the top-k recipe switches compression on after the dense start, when Auto has
        # measured the link; Auto then picks what each bucket uses, running that one's recipe.
        compressor = (compressor_for(METHODS["topk"], args) if method == "auto"
                      else compressor_for(entry, args))
        kwargs = {"backend": args.backend, "error_feedback": entry.error_feedback}
        if method == "auto":
            kwargs["policy"] = Auto()
        if entry.recipe and optimizer is not None:
            kwargs.update(optimizer=optimizer, total_steps=args.steps, scheduler=scheduler)
        else:  # the ablation: plain error feedback, the old defaults
            kwargs.update(warmup_steps=GRADCOMP_WARMUP_STEPS, granularity="bucket")
        telemetry.gradcomp_state = gradcomp_ddp.register(model, compressor, **kwargs)
    else:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    return telemetry


def compressor_for(method, args, setting=None):
    """The gradcomp compressor of ``method`` (an :class:`experiments.catalog.Method`), from
    the registry: its name and the ``train`` argument that sets it, or ``setting``.

    ``--threshold auto`` is chosen from the gradients after warm-up (see
    choose_twobit_threshold); until then the placeholder 1.0 is never used, because the
    warm-up steps are dense.
    """
    from gradcomp.compressors import from_spec

    if setting is None:
        setting = getattr(args, method.setting)
        if setting == "auto":
            setting = 1.0
    text = repr(setting) if isinstance(setting, float) else str(setting)  # repr: the exact double
    return from_spec(f"{method.compressor}:{text}")


def initial_twobit_threshold(threshold: str):
    """The 2-bit threshold known before training: ``None`` for ``auto`` (chosen after the
    warm-up), ``"rms"``, or the fixed number."""
    if threshold in ("auto", "rms"):
        return None if threshold == "auto" else threshold
    return float(threshold)


def warm_up_kernels(compressor, backend: Optional[str], device) -> float:
    """Compile gradcomp's kernels (numba JIT, CUDA NVRTC) before training, on a dummy
    tensor, with and without residuals (numba specialises on both); returns the seconds
    it took. A one-time cost that a long training run amortises, so it is kept out of
    the step times."""
    import torch

    started = time.perf_counter()
    grad = torch.randn(8192, device=device)
    residual, out = torch.zeros_like(grad), torch.zeros_like(grad)
    for args in ((residual, residual), (None, None), (residual, None)):
        payload = compressor.compress(grad, *args, backend=backend)
        compressor.decompress_add(payload, out, backend=backend)
    return time.perf_counter() - started


def choose_twobit_threshold(model, scale: float = AUTO_THRESHOLD_SCALE) -> float:
    """``scale`` x RMS of the gradients now in ``model`` (after a dense, averaged step),
    broadcast from rank 0 so every rank decodes with the same threshold.

    Why relative to the RMS: MXNet's default 0.5 assumes raw (batch-summed) gradients
    of order one; the mean-reduced gradients here have entries around 1e-3 (digits) to
    1e-2 (charlm), so 0.5 would send nothing for hundreds of steps, while a threshold far
    below the typical entry sends a sign every step and lets error feedback's residual
    grow without bound for large entries. At ``4 x RMS`` a typical entry is sent every
    few steps and the residual stays bounded. Measured here (300 steps, AdamW, seed 0,
    error feedback): digits test accuracy 0.76 / 0.91 / 0.96 / 0.98 at 1 / 2 / 4 / 8 x
    RMS (dense 0.97); charlm --small held-out loss 2.86 / 2.89 / 2.96 / 3.00 (dense
    2.15). 4 x RMS is the compromise; ``--threshold-scale`` changes it.
    """
    import torch
    import torch.distributed as dist

    from gradcomp import inflight

    squares = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None)
    count = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
    device = next(model.parameters()).device
    threshold = torch.tensor([scale * math.sqrt(squares / max(count, 1))], dtype=torch.float64, device=device)
    (handed,) = inflight.hold(threshold)
    dist.broadcast(handed, src=0)
    value = float(threshold)
    if not value > 0 or not math.isfinite(value):
        raise RuntimeError(f"auto 2-bit threshold is {value}; the warm-up gradients are zero or not finite")
    return value


#: The top-k density of the convergence study's and the step-time benchmark's gradcomp methods.
STUDY_DENSITY = 0.01


class StudyTelemetry:
    """``bytes_sent`` and ``dense_bytes`` per step (integers) of a study method: gradcomp's from its
    state's stats, the others' from their :class:`Telemetry`."""

    def __init__(self, telemetry: Optional[Telemetry] = None, state=None):
        self.telemetry, self.state = telemetry, state

    def end_step(self) -> dict:
        out = self.state.stats()["last_step"] if self.state is not None else self.telemetry.end_step()
        return {"bytes_sent": int(out["bytes_sent"]), "dense_bytes": int(out["dense_bytes"])}


def study_spec(base: str, model, optimizer, run_steps: int) -> str:
    """The compressor spec of the study's ``topk`` or ``twobit`` (``base``): top-k at :data:`STUDY_DENSITY`;
    2-bit as the recipe codes it for a ``run_steps``-step run of ``model`` under ``optimizer``
    (:func:`gradcomp.recipe.code`: 3-bit or the ternary chunk code), so that a benchmark that plans for
    fewer steps times the code of the run it stands for."""
    from gradcomp.compressors import TwoBit
    from gradcomp.recipe import code
    from gradcomp.recipe_bytes import Traffic
    from gradcomp.settings import DEFAULT_MIN_NUMEL

    if base != "twobit":
        return f"topk:{STUDY_DENSITY}"
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return code(TwoBit("chunk"), optimizer, run_steps, None, Traffic.of(named, DEFAULT_MIN_NUMEL)).spec


def attach_study_method(model, method: str, optimizer, scheduler, total_steps: int, seed: int = 0,
                        dense_bytes: Optional[int] = None, code_steps: Optional[int] = None) -> StudyTelemetry:
    """Register a method of the convergence study (``experiments.convergence.METHODS``) or ``noop`` on the
    DDP ``model``: torch's (``dense``, ``fp16``, ``powersgd``) through :func:`attach_method`; gradcomp's
    ``topk``, ``twobit``, ``auto`` with the one-call recipe over ``total_steps`` (``-noef``: without error
    feedback; ``-plain``: plain error feedback after 2 dense steps, no recipe), top-k at
    :data:`STUDY_DENSITY`, 2-bit at a level per chunk. ``code_steps``: the length of the run whose 2-bit
    code the recipe runs (:func:`study_spec`), where it plans for fewer steps than the run (a step-time
    benchmark at the final setting)."""
    import argparse

    import gradcomp
    from gradcomp.hooks import ddp as gradcomp_ddp

    if method in ("noop", "dense", "fp16", "powersgd"):
        if dense_bytes is None:
            dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        args = argparse.Namespace(seed=seed, density=STUDY_DENSITY, threshold="chunk", backend=None)
        return StudyTelemetry(attach_method(model, method, args, dense_bytes))
    base, _, variant = method.partition("-")
    if code_steps is not None and variant != "plain":
        spec_text = study_spec(base, model, optimizer, code_steps)
    else:
        spec_text = "twobit:chunk" if base == "twobit" else f"topk:{STUDY_DENSITY}"
    if variant == "plain":
        return StudyTelemetry(state=gradcomp_ddp.register(model, spec_text, warmup_steps=2))
    kwargs = {"error_feedback": variant != "noef"}
    if base == "auto":
        kwargs["policy"] = gradcomp.Auto()
    return StudyTelemetry(state=gradcomp_ddp.register(model, spec_text, optimizer=optimizer, total_steps=total_steps,
                                                      scheduler=scheduler, **kwargs))
