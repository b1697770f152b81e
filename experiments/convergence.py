"""The convergence study: does compressed training reach the dense held-out loss?

Every run is real data-parallel training through the product path: ``--nproc`` ranks (default
2) x 1 thread, DDP over Gloo, the gradient-communication method registered as DDP's comm hook,
inside a network namespace whose loopback is shaped to ``--link`` (default 1 Gbit/s, see
``netem.py``; without root it falls back to the unshaped loopback and says so), so step times
are measured on that link.

Methods (``method`` in the rows) and what each one runs:

================  =============================================================================
``dense``         DDP's built-in allreduce, fp32
``fp16``          torch's ``fp16_compress_hook``
``powersgd``      torch's PowerSGD hook, rank 4, error feedback, 2 dense steps
``topk``          the one-call recipe, ``register(model, "topk:0.01", optimizer=, total_steps=,
                  scheduler=)``: SGD-momentum -> DGC momentum correction (the momentum moves
                  into gradcomp), AdamW -> its variance frozen after the dense start and the
                  momentum exchanged in update units; a sparsity ramp sized to the byte budget
``twobit``        the same call with ``"twobit:rms"`` (scale per parameter and step); under
                  SGD-momentum the momentum stays in the optimizer (1-bit SGD's arrangement)
``auto``          the top-k recipe with ``policy=gradcomp.Auto()`` (dense, fp16, 2-bit or top-k
                  per bucket, each running its recipe)
``topk-noef``     the ``topk`` recipe with error feedback off
``twobit-noef``   the ``twobit`` recipe with error feedback off
``topk-naive``    the path without the recipe: top-k 1%, error feedback, 2 dense steps, whole
                  buckets, the optimizer unchanged (momentum / live Adam)
``twobit-naive``  the same with one fixed threshold, 4 x the gradient RMS at the last dense step
================  =============================================================================

Optimizers: ``adamw`` (lr 1e-3, weight decay 0) and ``sgdm`` (SGD, momentum 0.9, lr 0.1 for
charlm, 0.05 for digits); both with a linear LR warm-up of ``min(20, steps // 10)`` steps and a
cosine decay to 10% (as ``train.py``), given to the runs as a ``LambdaLR`` scheduler. Every run
uses DDP's default buckets (``"buckets": "default"`` in its row).

Outputs in ``--out``:

* ``runs/<workload>__<optimizer>__<method>__s<seed>.jsonl``: each run's log (rank 0);
* ``convergence.json``: a list of rows, one per run: ``workload``, ``optimizer``, ``method``,
  ``seed``, ``steps``, ``final_loss`` (held-out), ``final_accuracy`` (digits; else null),
  ``bytes_total`` (bytes this rank handed to collectives over the run, warm-up included),
  ``dense_bytes_total`` (what dense fp32 allreduces of the same steps hand over),
  ``compression`` (dense / sent), ``time_to_dense_loss_s`` (training time until the held-out
  loss first reaches the dense run's final held-out loss, same workload/optimizer/seed, at the
  evaluation points; null if never), ``train_time_s``, ``median_step_time_s``, ``link``,
  ``gap_to_dense`` (final_loss / dense final_loss - 1);
* ``convergence.md``: the table; ``<workload>_<optimizer>_loss_vs_step.png`` and
  ``..._loss_vs_time.png``.

Modes: the full study (charlm-small 2000 steps, the GRU ``proselm`` 600 steps and digits 1000
steps, both optimizers, every method; each run is skipped if its log is already complete, so an
interrupted study resumes);
``--quick``: a 1-layer charlm, 12 steps, a few methods (the smoke test); ``--only`` filters runs
(``workload/optimizer/method``, ``*`` allowed); ``--aggregate`` only rebuilds the outputs.

Example::

    python -m experiments.convergence --out experiments/results/convergence
    python -m experiments.convergence --out /tmp/conv --quick
"""
from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

METHODS = ("dense", "fp16", "powersgd", "topk", "twobit", "auto", "topk-noef", "twobit-noef", "topk-naive",
           "twobit-naive")
OPTIMIZERS = ("adamw", "sgdm")
TOPK_DENSITY = 0.01
IN_PROGRESS_S = 120.0  # a log written to this recently belongs to a run still going elsewhere
NAIVE_WARMUP_STEPS = 2  # today's default dense steps (DDP's bucket rebuild)
NAIVE_THRESHOLD_SCALE = 4.0  # today's 2-bit threshold: 4 x the gradient RMS at the last dense step
#: How the runs bucket their gradients (recorded in every row): DDP's default buckets.
BUCKETS = "default"


@dataclass(frozen=True)
class RunSpec:
    """One training run of the study."""

    workload: str  # "charlm-small", "charlm-tiny" or "digits"
    optimizer: str  # "adamw" or "sgdm"
    method: str
    seed: int
    steps: int
    eval_every: int
    eval_windows: int = 256

    @property
    def stem(self) -> str:
        return f"{self.workload}__{self.optimizer}__{self.method}__s{self.seed}"


# ---------------------------------------------------------------------------------------
# One rank.
# ---------------------------------------------------------------------------------------


def _build_workload(name: str, seed: int, eval_windows: int):
    from experiments import workloads

    if name == "charlm-small":
        return workloads.build_workload("charlm", seed=seed, small=True, eval_windows=eval_windows)
    if name == "charlm-tiny":
        overrides = {"d_model": 32, "layers": 1, "heads": 2, "context": 16}
        return workloads.build_workload("charlm", seed=seed, small=True, charlm_overrides=overrides,
                                        eval_windows=eval_windows)
    if name == "proselm":
        return workloads.build_workload("proselm", seed=seed, eval_windows=eval_windows)
    if name == "digits":
        return workloads.build_workload("digits", seed=seed)
    raise ValueError(f"unknown workload {name!r}")


def peak_lr(spec: RunSpec) -> float:
    if spec.optimizer == "adamw":
        return 1e-3
    return 0.05 if spec.workload == "digits" else 0.1


def lr_at(step: int, peak: float, steps: int) -> float:
    """Linear warm-up over ``min(20, steps // 10)`` steps, then cosine decay to 10% of the peak
    at the last step (the schedule of ``train.py``)."""
    warmup = min(20, steps // 10)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class _TorchHookTelemetry:
    """Bytes per step for DDP's allreduce and torch's hooks (through ``train.attach_method``)."""

    def __init__(self, telemetry):
        self.telemetry = telemetry

    def end_step(self) -> Dict[str, int]:
        out = self.telemetry.end_step()
        return {"bytes_sent": int(out["bytes_sent"]), "dense_bytes": int(out["dense_bytes"])}


class _GradcompTelemetry:
    def __init__(self, state):
        self.state = state

    def end_step(self) -> Dict[str, int]:
        last = self.state.stats()["last_step"]
        return {"bytes_sent": int(last["bytes_sent"]), "dense_bytes": int(last["dense_bytes"])}


def attach(model, net, spec: RunSpec, lr: float):
    """Register ``spec.method`` on the DDP ``model``; return ``(optimizer, scheduler, telemetry,
    on_step_end, compressor)`` (``compressor``: gradcomp's base compressor, or ``None``).

    The optimizer and its LR scheduler are built first, as a user's script has them; gradcomp's
    recipes are then the one call ``register(model, spec, optimizer=, total_steps=, scheduler=)``,
    which derives everything else from the run. ``on_step_end(step)`` runs after each optimizer
    step (the naive 2-bit threshold is chosen there, as ``train.py`` does)."""
    import torch

    import gradcomp
    from experiments import train
    from gradcomp.hooks import ddp as gradcomp_ddp

    dense_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
    if spec.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, lr, spec.steps) / lr)

    def no_step_hook(step):
        return None

    if spec.method in ("dense", "fp16", "powersgd"):
        args = argparse.Namespace(seed=spec.seed, density=TOPK_DENSITY, threshold="rms", backend=None)
        telemetry = train.attach_method(model, spec.method, args, dense_bytes)
        return optimizer, scheduler, _TorchHookTelemetry(telemetry), no_step_hook, None

    base, _, variant = spec.method.partition("-")
    if variant == "naive":
        compressor = gradcomp.TopK(TOPK_DENSITY) if base == "topk" else gradcomp.TwoBit(1.0)
        state = gradcomp_ddp.register(model, compressor, warmup_steps=NAIVE_WARMUP_STEPS, granularity="bucket")

        def choose_threshold(step):
            if base == "twobit" and step == NAIVE_WARMUP_STEPS - 1:
                state.engine.compressor = gradcomp.TwoBit(train.choose_twobit_threshold(net, NAIVE_THRESHOLD_SCALE))

        return optimizer, scheduler, _GradcompTelemetry(state), choose_threshold, compressor

    spec_text = "twobit:rms" if base == "twobit" else f"topk:{TOPK_DENSITY}"
    kwargs = {"error_feedback": variant != "noef"}
    if base == "auto":
        kwargs["policy"] = gradcomp.Auto()
    state = gradcomp_ddp.register(model, spec_text, optimizer=optimizer, total_steps=spec.steps, scheduler=scheduler,
                                  **kwargs)
    return optimizer, scheduler, _GradcompTelemetry(state), no_step_hook, state.engine.compressor


def run_rank(rank: int, world_size: int, spec: RunSpec, log_path: Optional[str], timeout_s: float) -> None:
    """Train ``spec`` on this rank (the process group comes from ``MASTER_ADDR/PORT``); rank 0
    writes the JSON-lines log."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[name] = "1"
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    log = open(log_path, "w") if (rank == 0 and log_path) else None
    try:
        workload = _build_workload(spec.workload, spec.seed, spec.eval_windows)
        net = workload.build_model()
        # DDP's default buckets, as a user has them: the engine compresses each parameter of a
        # bucket on its own (its own top-k budget and 2-bit scale).
        model = DistributedDataParallel(net)
        lr = peak_lr(spec)
        optimizer, scheduler, telemetry, on_step_end, compressor = attach(model, net, spec, lr)
        if compressor is not None:  # JIT-compile the kernels outside the timed steps, as train.py does
            from experiments import train

            train.warm_up_kernels(compressor, None, torch.device("cpu"))
        batch_size = workload.default_batch_size

        def emit(record: dict) -> None:
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()

        def evaluate(step: int, train_time: float) -> None:
            net.eval()
            sums = workload.evaluate_sums(net, rank, world_size, torch.device("cpu"))
            net.train()
            dist.all_reduce(sums)
            emit({"event": "eval", "step": step, "train_time_s": train_time, **workload.metrics(sums)})

        emit({"event": "config", **asdict(spec), "buckets": BUCKETS, "lr": lr, "world_size": world_size,
              "batch_size": batch_size,
              "link": os.environ.get("GRADCOMP_LINK", "unshaped"), "torch": torch.__version__,
              "params": sum(p.numel() for p in net.parameters())})  # fmt: skip
        evaluate(-1, 0.0)
        train_time = 0.0
        for step in range(spec.steps):
            x, y = workload.batch(rank, step, batch_size)
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = workload.loss(model, x, y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step_time = time.perf_counter() - started
            train_time += step_time
            on_step_end(step)
            emit({"event": "step", "step": step, "loss": float(loss.detach()), "step_time_s": step_time,
                  "train_time_s": train_time, **telemetry.end_step()})  # fmt: skip
            if (step + 1) % spec.eval_every == 0 or step + 1 == spec.steps:
                evaluate(step, train_time)
        emit({"event": "done", "steps": spec.steps, "train_time_s": train_time})
        dist.barrier()
    finally:
        if log is not None:
            log.close()
        dist.destroy_process_group()


def run_worker(spec: RunSpec, log_path: str, nproc: int, timeout_s: float) -> int:
    """Spawn ``nproc`` local ranks of ``spec``; the exit status (0 when every rank succeeded)."""
    import multiprocessing

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from experiments import train

    os.environ["MASTER_PORT"] = str(train.free_port())
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_rank, args=(r, nproc, spec, log_path, 300.0)) for r in range(nproc)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in processes):
            break
        processes[0].join(timeout=0.5)
    status = 0
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(timeout=10)
            status = status or 124
        status = status or (process.exitcode or 0)
    return status


# ---------------------------------------------------------------------------------------
# The study.
# ---------------------------------------------------------------------------------------


def plan(quick: bool, seeds: List[int]) -> List[RunSpec]:
    """The study's runs, most informative first (so an interrupted study still answers the
    main question: recipes against dense, then the ablations, then the other baselines)."""
    if quick:
        methods = ("dense", "topk", "twobit", "topk-naive")
        return [RunSpec("charlm-tiny", o, m, s, 12, 6, 8) for s in seeds for o in OPTIMIZERS for m in methods]
    recipes = ("dense", "topk", "twobit")
    ablations = ("auto", "topk-noef", "twobit-noef", "topk-naive", "twobit-naive")
    others = ("fp16", "powersgd")
    runs = []
    for seed in seeds:
        runs += [RunSpec("charlm-small", o, m, seed, 2000, 40) for o in ("sgdm", "adamw") for m in recipes]
    for seed in seeds:  # the held-out architecture and corpus, beside charlm-small
        runs += [RunSpec("proselm", o, m, seed, 600, 20) for o in ("adamw", "sgdm") for m in recipes]
    for seed in seeds:  # digits is ~10x cheaper: its whole matrix before charlm's ablations
        runs += [RunSpec("digits", o, m, seed, 1000, 100) for o in OPTIMIZERS for m in recipes + ablations + others]
    for seed in seeds:
        runs += [RunSpec("charlm-small", o, m, seed, 2000, 100) for m in ablations + others for o in OPTIMIZERS]
    return runs


def read_log(path: str) -> List[dict]:
    records = []
    if not os.path.exists(path):
        return records
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a run cut off mid-line
    return records


def is_complete(path: str) -> bool:
    return any(r.get("event") == "done" for r in read_log(path))


def summarize(spec: RunSpec, path: str) -> Optional[dict]:
    """One row from a complete log (``None`` if the log is incomplete)."""
    records = read_log(path)
    if not any(r.get("event") == "done" for r in records):
        return None
    config = next(r for r in records if r.get("event") == "config")
    steps = [r for r in records if r.get("event") == "step"]
    evals = [r for r in records if r.get("event") == "eval" and r["step"] >= 0]
    final = evals[-1]
    bytes_total = sum(r["bytes_sent"] for r in steps)
    dense_total = sum(r["dense_bytes"] for r in steps)
    skip = min(len(steps) // 2, 5)
    return {
        **asdict(spec),
        "buckets": config.get("buckets", BUCKETS),
        "final_loss": final["eval_loss"],
        "final_accuracy": final.get("accuracy"),
        "bytes_total": bytes_total,
        "dense_bytes_total": dense_total,
        "compression": dense_total / bytes_total if bytes_total else None,
        "train_time_s": steps[-1]["train_time_s"],
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steps[skip:]),
        "final_train_loss": statistics.fmean(r["loss"] for r in steps[-max(1, min(50, len(steps) // 5)) :]),
        "link": config.get("link"),
        "evals": [(r["step"], r["train_time_s"], r["eval_loss"]) for r in evals],
        "log": os.path.relpath(path),
    }


def add_dense_comparisons(rows: List[dict]) -> None:
    """``time_to_dense_loss_s`` and ``gap_to_dense`` against the dense run of the same
    workload, optimizer, seed and steps."""
    dense = {(r["workload"], r["optimizer"], r["seed"], r["steps"]): r for r in rows if r["method"] == "dense"}
    for row in rows:
        reference = dense.get((row["workload"], row["optimizer"], row["seed"], row["steps"]))
        row["time_to_dense_loss_s"] = None
        row["gap_to_dense"] = None
        row["time_vs_dense"] = None
        if reference is None:
            continue
        target = reference["final_loss"]
        row["gap_to_dense"] = row["final_loss"] / target - 1
        for _, train_time, loss in row["evals"]:
            if loss <= target:
                row["time_to_dense_loss_s"] = train_time
                break
        if row["time_to_dense_loss_s"] is not None and reference["train_time_s"]:
            row["time_vs_dense"] = row["time_to_dense_loss_s"] / reference["train_time_s"]


def _fmt(value, pattern="{:.3f}") -> str:
    return "–" if value is None else pattern.format(value)


def markdown(rows: List[dict]) -> str:
    lines = [
        "| workload | optimizer | method | seed | steps | final loss | gap to dense | accuracy | compression "
        "(dense / sent bytes) | time to dense loss (s) | vs dense | median step (s) | link |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['optimizer']} | {r['method']} | {r['seed']} | {r['steps']} | "
            f"{_fmt(r['final_loss'])} | {_fmt(r['gap_to_dense'], '{:+.1%}')} | {_fmt(r['final_accuracy'], '{:.3f}')} | "
            f"{_fmt(r['compression'], '{:.1f}x')} | {_fmt(r['time_to_dense_loss_s'], '{:.1f}')} | "
            f"{_fmt(r['time_vs_dense'], '{:.2f}x')} | {_fmt(r['median_step_time_s'], '{:.4f}')} | {r['link']} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: List[dict], out: str) -> List[str]:
    """Held-out loss vs step and vs training time, one figure per workload x optimizer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    groups: Dict[tuple, List[dict]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["optimizer"]), []).append(row)
    for (workload, optimizer), members in sorted(groups.items()):
        for axis, index, label in (("step", 0, "step"), ("time", 1, "training time at the link (s)")):
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for row in sorted(members, key=lambda r: (METHODS.index(r["method"]), r["seed"])):
                xs = [e[index] for e in row["evals"]]
                ys = [e[2] for e in row["evals"]]
                style = "--" if ("noef" in row["method"] or "naive" in row["method"]) else "-"
                ax.plot(xs, ys, style, label=f"{row['method']} s{row['seed']}", linewidth=1.2)
            ax.set_xlabel(label)
            ax.set_ylabel("held-out loss")
            ax.set_title(f"{workload}, {optimizer}")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
            path = os.path.join(out, f"{workload}_{optimizer}_loss_vs_{axis}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def aggregate(out: str, specs: List[RunSpec]) -> List[dict]:
    """Rows from every complete log in ``out/runs`` (those of ``specs`` first); writes the
    JSON, the table and the plots."""
    runs_dir = os.path.join(out, "runs")
    rows = []
    seen = set()
    known = {spec.stem: spec for spec in specs}
    for name in sorted(os.listdir(runs_dir)) if os.path.isdir(runs_dir) else []:
        if not name.endswith(".jsonl"):
            continue
        stem = name[: -len(".jsonl")]
        spec = known.get(stem)
        if spec is None:
            config = next((r for r in read_log(os.path.join(runs_dir, name)) if r.get("event") == "config"), None)
            if config is None:
                continue
            spec = RunSpec(**{k: config[k] for k in RunSpec.__dataclass_fields__})
        row = summarize(spec, os.path.join(runs_dir, name))
        if row is not None and stem not in seen:
            seen.add(stem)
            rows.append(row)
    rows.sort(key=lambda r: (r["workload"], r["optimizer"], METHODS.index(r["method"]), r["seed"]))
    add_dense_comparisons(rows)
    with open(os.path.join(out, "convergence.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "convergence.md"), "w") as f:
        f.write("# Convergence study\n\n" + markdown(rows))
    plot(rows, out)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--quick", action="store_true", help="a short smoke run (1-layer charlm, 12 steps)")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--only", action="append", default=[], help="run only workload/optimizer/method (glob)")
    parser.add_argument("--link", default="1gbit", help="link rate for the runs (tc syntax) or 'unshaped'")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--aggregate", action="store_true", help="only rebuild the outputs from the logs")
    parser.add_argument("--run-timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a RunSpec as JSON: run it here
    parser.add_argument("--log", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(RunSpec(**json.loads(args.worker)), args.log, args.nproc, args.run_timeout)
    from experiments import netem

    seeds = [int(s) for s in args.seeds.split(",")]
    specs = plan(args.quick, seeds)
    if args.only:
        specs = [s for s in specs
                 if any(fnmatch.fnmatch(f"{s.workload}/{s.optimizer}/{s.method}", p) for p in args.only)]
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    failures = 0
    if not args.aggregate:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        with netem.link(args.link) as link:
            for index, spec in enumerate(specs):
                log_path = os.path.abspath(os.path.join(runs_dir, spec.stem + ".jsonl"))
                if is_complete(log_path):
                    continue
                if os.path.exists(log_path) and time.time() - os.path.getmtime(log_path) < IN_PROGRESS_S:
                    print(f"[{index + 1}/{len(specs)}] {spec.stem}: being written by another run; skipped", flush=True)
                    continue
                started = time.monotonic()
                command = [sys.executable, "-m", "experiments.convergence", "--out", args.out, "--worker",
                           json.dumps(asdict(spec)), "--log", log_path, "--nproc", str(args.nproc),
                           "--run-timeout", str(args.run_timeout)]  # fmt: skip
                env = link.env()
                env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
                with open(os.path.join(runs_dir, spec.stem + ".out"), "w") as output:
                    status = netem.run_bounded(
                        link.command(command), timeout=args.run_timeout + 60, env=env, stdout=output,
                        stderr=subprocess.STDOUT, cwd=root,
                    )  # fmt: skip
                # A complete log is a finished run even if a rank then died in teardown (the
                # known intermittent exit-time abort after Numba kernels); the status is shown.
                ok = is_complete(log_path)
                failures += not ok
                print(f"[{index + 1}/{len(specs)}] {spec.stem}: {'ok' if ok else 'FAILED'} (status {status}) "
                      f"in {time.monotonic() - started:.0f}s", flush=True)  # fmt: skip
    rows = aggregate(args.out, specs)
    print(markdown(rows), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
