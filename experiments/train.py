"""DDP training runner: one workload, one gradient-communication method, N ranks.

Runs over Gloo on CPU (NCCL when CUDA is available). It either spawns ``--nproc`` local
ranks itself, or, when launched by ``torchrun`` (``RANK``/``WORLD_SIZE`` set), runs as
one of torchrun's ranks.

Methods (``--compressor``): the table in :mod:`experiments.catalog`, which ``--help``
prints. gradcomp's methods build their compressor from the registry:
``from_spec("topk:<--density>")``, ``from_spec("twobit:<--threshold>")``.

Timing. ``step_time_s`` is the wall time, on rank 0, of zero_grad + forward + backward +
optimizer step. DDP waits for every bucket's communication future at the end of
backward, so the collective has completed inside that window (with CUDA the device is
synchronised before reading the clock). Data loading, logging and evaluation are outside
it. ``train_time_s`` is the running sum of step times: the x axis of loss-vs-time plots.

Breakdown. One run cannot separate computation from communication that overlaps it, so
the split is made across runs (see ``experiments.compare``): ``compute`` is the median step time of
the ``noop`` run on the same workload and link; ``compress_s`` is measured here, per step,
as the time on the calling thread inside the compression hook (gradcomp's own
``state.stats()`` for top-k/2-bit, a timer around torch's hook for fp16/PowerSGD; 0 for
dense); communication is the rest (exposed communication, decompression and waiting).

Bytes. ``bytes_sent`` is what this rank handed to collectives in the step (allreduce:
the buffer; allgather: its own payload), ``dense_bytes`` what a dense fp32 allreduce
would hand over. With 2 ranks both equal the bytes each rank actually puts on the wire
(a ring allreduce sends ``2 (P-1)/P`` buffers, an allgather ``(P-1)`` payloads). Inside a
private network namespace (``experiments.netem``) ``wire_bytes`` is also measured: the growth of
the namespace loopback's ``tx_bytes`` during the step, divided by the world size.

Log (``--log``, JSON lines, rank 0): one ``{"event": "config", ...}`` line, one
``{"event": "step", ...}`` per step, ``{"event": "eval", ...}`` lines, and a final
``{"event": "summary", ...}``.

Examples (from the repository root)::

    python -m experiments.train --workload charlm --compressor topk --density 0.01 \\
        --steps 50 --log results/topk.jsonl
    torchrun --nproc-per-node 2 -m experiments.train --workload digits --compressor twobit
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import time
import warnings
from typing import Callable, Optional

from experiments.catalog import METHODS

GRADCOMP_WARMUP_STEPS = 2  # dense steps before compression starts (gradcomp and PowerSGD alike)
# --threshold auto: t = AUTO_THRESHOLD_SCALE x RMS of the averaged gradient of the last
# warm-up step (see choose_twobit_threshold).
AUTO_THRESHOLD_SCALE = 4.0
NETNS_ENV = "GRADCOMP_NETNS"  # set by experiments.netem: the name of the private namespace we run in


def parse_args(argv=None) -> argparse.Namespace:
    methods = "\n".join(f"  {m.name:12s} {m.description}" for m in METHODS.values())
    parser = argparse.ArgumentParser(
        prog="python -m experiments.train",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"methods (--compressor):\n{methods}",
    )  # fmt: skip
    parser.add_argument("--workload", choices=("charlm", "digits"), default="charlm")
    parser.add_argument("--small", action="store_true", help="charlm: the small preset (d_model 128, 2 layers)")
    parser.add_argument("--d-model", type=int, help="charlm: override the preset's width")
    parser.add_argument("--layers", type=int, help="charlm: override the preset's depth")
    parser.add_argument("--heads", type=int, help="charlm: override the preset's heads")
    parser.add_argument("--context", type=int, help="charlm: override the preset's context length")
    parser.add_argument("--compressor", choices=tuple(METHODS), default="dense", help="the method (see below)")
    parser.add_argument(
        "--density", type=float, default=0.01, help="top-k: the fraction of entries sent (default 0.01)"
    )
    parser.add_argument(
        "--threshold",
        default="rms",
        help="2-bit threshold: 'rms' (default: per parameter and step, see gradcomp.TwoBit), a positive number, "
        "or 'auto': --threshold-scale x the RMS of the averaged gradient at the last dense warm-up step",
    )
    parser.add_argument(
        "--threshold-scale", type=float, default=AUTO_THRESHOLD_SCALE,
        help="2-bit with --threshold auto: the threshold in units of the gradient RMS "
        f"(default {AUTO_THRESHOLD_SCALE})",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=100, help="training steps (every run is bounded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizer", choices=("adamw", "sgd"), default="adamw", help="AdamW, or SGD with momentum 0.9"
    )
    parser.add_argument("--lr", type=float, help="peak learning rate (default: AdamW 1e-3, SGD 0.1)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch (default: charlm 16, digits 32)")
    parser.add_argument("--lr-warmup", type=int, help="linear LR warm-up steps (default: min(20, steps // 10))")
    parser.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    parser.add_argument("--eval-windows", type=int, default=64, help="charlm: held-out windows per evaluation")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    parser.add_argument("--threads", type=int, default=1, help="torch and numba threads per rank")
    parser.add_argument("--log", help="JSON-lines log written by rank 0")
    parser.add_argument("--timeout", type=float, default=300.0, help="process-group timeout, seconds")
    parser.add_argument("--max-time", type=float, default=3600.0, help="wall-clock limit of the whole run, seconds")
    parser.add_argument("--backend", help="gradcomp kernel backend override (one of gradcomp.backends.BACKENDS)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.nproc < 1 or args.threads < 1:
        parser.error("--nproc and --threads must be >= 1")
    if not args.threshold_scale > 0 or not math.isfinite(args.threshold_scale):
        parser.error("--threshold-scale must be a positive number")
    if args.threshold not in ("auto", "rms"):
        try:
            value = float(args.threshold)
        except ValueError:
            value = math.nan
        if not value > 0 or not math.isfinite(value):
            parser.error(f"--threshold must be a positive number, 'rms' or 'auto', got {args.threshold!r}")
    if args.backend is not None:
        # Only when asked: gradcomp imports torch, which the launching process otherwise avoids.
        from gradcomp.backends import BACKENDS

        if args.backend not in BACKENDS:
            parser.error(f"--backend must be one of {', '.join(BACKENDS)}, got {args.backend!r}")
    return args


# ---------------------------------------------------------------------------------------
# Communication methods and their per-step telemetry.
# ---------------------------------------------------------------------------------------


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
    inflight.hold(threshold)
    dist.broadcast(threshold, src=0)
    value = float(threshold)
    if not value > 0 or not math.isfinite(value):
        raise RuntimeError(f"auto 2-bit threshold is {value}; the warm-up gradients are zero or not finite")
    return value


# ---------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------


def _lo_tx_bytes() -> Optional[int]:
    """Bytes sent on the loopback, when it is our private namespace's (else ``None``:
    the host loopback also carries other people's traffic)."""
    if not os.environ.get(NETNS_ENV):
        return None
    try:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _set_thread_env(threads: int) -> None:
    # Must happen before numba (gradcomp's CPU backend) or OpenMP are first imported.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = str(threads)


def run_rank(rank: int, world_size: int, local_rank: int, args: argparse.Namespace) -> None:
    """Train on this rank; rank 0 logs. The process group is set up from the environment
    (``MASTER_ADDR``/``MASTER_PORT``)."""
    from experiments import netem

    netem.join_rank_namespace(rank)  # a full-duplex emulated link: this rank's own namespace (else nothing)
    _set_thread_env(args.threads)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from experiments import workloads
    from gradcomp import inflight

    # A 1-channel conv's weight grad may get strides that differ from its bucket view;
    # DDP copies it correctly and warns once per rank, which is only noise here.
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=args.timeout))
    log = open(args.log, "w") if (rank == 0 and args.log) else None
    try:
        workload = workloads.build_workload(
            args.workload,
            seed=args.seed,
            small=args.small,
            charlm_overrides={
                "d_model": args.d_model,
                "layers": args.layers,
                "heads": args.heads,
                "context": args.context,
            },
            eval_windows=args.eval_windows,
        )
        batch_size = args.batch_size or workload.default_batch_size
        lr = args.lr or (workload.default_lr if args.optimizer == "adamw" else 0.1)
        lr_warmup = args.lr_warmup if args.lr_warmup is not None else min(20, args.steps // 10)
        net = workload.build_model().to(device)
        params = sum(p.numel() for p in net.parameters())
        dense_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
        model = DistributedDataParallel(net, device_ids=[local_rank] if cuda else None)
        if args.optimizer == "adamw":
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

        def lr_at(step: int) -> float:
            # Linear warm-up, then cosine decay to 10% of the peak at the last step.
            if step < lr_warmup:
                return lr * (step + 1) / lr_warmup
            progress = (step - lr_warmup) / max(1, args.steps - lr_warmup)
            return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step) / lr)
        telemetry = attach_method(model, args.compressor, args, dense_bytes, optimizer, scheduler)
        kernel_warmup_s = 0.0
        if telemetry.gradcomp_state is not None:
            kernel_warmup_s = warm_up_kernels(telemetry.gradcomp_state.engine.compressor, args.backend, device)

        def emit(record: dict) -> None:
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()

        def evaluate(step: int, train_time: float) -> dict:
            net.eval()
            sums = workload.evaluate_sums(net, rank, world_size, device)
            net.train()
            inflight.hold(sums)  # Gloo's thread must not be the last owner of a Python tensor at exit
            dist.all_reduce(sums)
            metrics = workload.metrics(sums.cpu())
            emit({"event": "eval", "step": step, "train_time_s": train_time, **metrics})
            return metrics

        emit(
            {
                "event": "config",
                **{k: v for k, v in vars(args).items()},
                **workload.describe(),
                "params": params,
                "dense_bytes": dense_bytes,
                "kernel_warmup_s": kernel_warmup_s,
                "world_size": world_size,
                "process_group_backend": backend,
                "device": str(device),
                "batch_size": batch_size,
                "lr": lr,
                "lr_warmup": lr_warmup,
                "netns": os.environ.get(NETNS_ENV),
                "link": os.environ.get("GRADCOMP_LINK", "unknown"),
                "torch": torch.__version__,
                "hostname": socket.gethostname(),
            }
        )

        progress = None
        if rank == 0 and not args.no_progress:
            from tqdm import tqdm

            progress = tqdm(total=args.steps, desc=f"{args.workload}/{args.compressor}", unit="step", file=sys.stderr)

        train_time = 0.0
        threshold = initial_twobit_threshold(args.threshold)
        step_times, losses = [], []
        for step in range(args.steps):
            x, y = workload.batch(rank, step, batch_size)
            x, y = x.to(device), y.to(device)
            tx_before = _lo_tx_bytes()
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(model, x, y)
            loss.backward()  # returns once every bucket's collective has completed
            optimizer.step()
            scheduler.step()
            if cuda:
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - started
            tx_after = _lo_tx_bytes()
            train_time += step_time
            comm = telemetry.end_step()
            loss_value = float(loss.detach())
            step_times.append(step_time)
            losses.append(loss_value)
            record = {
                "event": "step",
                "step": step,
                "loss": loss_value,
                "step_time_s": step_time,
                "train_time_s": train_time,
                "lr": lr_at(step),
                **comm,
            }
            if tx_before is not None and tx_after is not None:
                record["wire_bytes"] = (tx_after - tx_before) / world_size
            emit(record)
            if progress is not None:
                progress.set_postfix(loss=f"{loss_value:.3f}", step_s=f"{step_time:.3f}")
                progress.update()
            if (args.compressor.startswith("twobit") and args.threshold == "auto" and step == GRADCOMP_WARMUP_STEPS - 1
                    and not METHODS[args.compressor].recipe):
                threshold = choose_twobit_threshold(net, args.threshold_scale)
                # The engine asks for its base compressor anew at every step: from the next one on
                # it compresses with the chosen threshold.
                telemetry.gradcomp_state.engine.compressor = compressor_for(METHODS[args.compressor], args, threshold)
                emit({"event": "threshold", "step": step, "threshold": threshold, "scale": args.threshold_scale})
            if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
                evaluate(step, train_time)
        if progress is not None:
            progress.close()
        final = evaluate(args.steps - 1, train_time)
        timed = step_times[min(len(step_times) - 1, GRADCOMP_WARMUP_STEPS + 2) :]
        summary = {
            "event": "summary",
            "workload": args.workload,
            "method": args.compressor,
            "steps": args.steps,
            "params": params,
            "median_step_time_s": statistics.median(timed),
            "train_time_s": train_time,
            "final_train_loss": statistics.fmean(losses[-max(1, min(10, len(losses) // 5)) :]),
            "twobit_threshold": threshold if args.compressor.startswith("twobit") else None,
            **final,
        }
        emit(summary)
        if rank == 0:
            print(json.dumps(summary), flush=True)
        dist.barrier()
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on the loopback for the ranks' rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(args: argparse.Namespace, target: Optional[Callable] = None) -> int:
    """Run ``args.nproc`` local ranks of ``target(rank, world_size, local_rank, args)`` (default
    :func:`run_rank`; ``experiments.fsdp_train`` passes its own), bounded by ``args.max_time``; the exit status.

    Plain ``multiprocessing`` with the spawn method: the parent never imports torch,
    which saves seconds per run on a small machine. A rank that fails prints its own
    traceback; the others are then stopped rather than left waiting in a collective.
    """
    import multiprocessing

    # Local ranks talk over the loopback only (inside netem's namespace it is the shaped
    # one; without GLOO_SOCKET_IFNAME Gloo would pick the interface of the hostname).
    # A full-duplex link (GRADCOMP_NETNS_RANKS) gives each rank its own namespace: netem set the
    # address of rank 0 there and the interface.
    if not os.environ.get("GRADCOMP_NETNS_RANKS"):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_PORT"] = str(free_port())
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=target or run_rank, args=(rank, args.nproc, rank, args), name=f"rank{rank}",
                        daemon=False)
        for rank in range(args.nproc)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + args.max_time
    try:
        while any(p.is_alive() for p in processes):
            failed = [p for p in processes if p.exitcode not in (None, 0)]
            if failed:
                print(
                    f"train: {failed[0].name} exited with status {failed[0].exitcode}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(processes)
                return 1
            if time.monotonic() > deadline:
                print(
                    f"train: --max-time {args.max_time:.0f}s exceeded; stopping the ranks", file=sys.stderr, flush=True
                )
                _stop(processes)
                return 124
            processes[0].join(timeout=0.5)
    except KeyboardInterrupt:
        _stop(processes)
        raise
    failed = [p for p in processes if p.exitcode != 0]
    if failed:
        print(f"train: {failed[0].name} exited with status {failed[0].exitcode}", file=sys.stderr, flush=True)
        return 1
    return 0


def _stop(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def main(argv=None) -> int:
    args = parse_args(argv)
    _set_thread_env(args.threads)
    if args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), args)
        return 0
    return spawn(args)


if __name__ == "__main__":
    sys.exit(main())
