"""FSDP2 training runner: one workload, one method, N ranks, every module under ``fully_shard``.

The FSDP twin of :mod:`experiments.train` (``--parallel fsdp`` of :mod:`experiments.compare`) and of the
convergence study's ranks (``--parallel fsdp`` of :mod:`experiments.convergence`, :func:`run_study`). Each
transformer block (every child of a ``ModuleList``) and then the whole model are wrapped with
``fully_shard``; the methods (``--compressor``):

========  ======================================================================================
noop      no communication: each rank keeps its own row of its own gradient (the compute floor)
dense     FSDP's own reduce-scatter (``ReduceOp.AVG``)
topk      ``gradcomp.hooks.fsdp.register(model, "topk:<density>", ...)`` with the one-call recipe
twobit    the same with ``"twobit:chunk"``
========  ======================================================================================

The recipe under FSDP: SGD (with momentum) takes the whole recipe (``optimizer=``); AdamW's stage cannot
run sharded, so AdamW takes the recipe's dense start and ramp without it (``total_steps=`` and
``scheduler=`` only), which the log records as ``"recipe"``. Logs are :mod:`experiments.train`'s (config,
step, eval, summary) plus ``done``, with ``"parallel": "fsdp"`` and ``"engine": "fsdp"`` in the config,
and gradcomp's residual bytes per rank (``residual_bytes``; ``--residual-dtype``, ``--residual-share``).
The ranks are :func:`experiments.runner.run_rank` with :class:`FsdpRun`.

Examples (from the repository root)::

    python -m experiments.fsdp_train --workload charlm --compressor topk --steps 30 --log /tmp/fsdp.jsonl
    python -m experiments.compare --matrix --parallel fsdp --workloads charlm --links 1gbit \\
        --methods noop,dense,topk,twobit --out results/fsdp
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from experiments import launch, methods
from experiments.runner import Run, run_rank, timing_summary

#: What ``--compressor`` may be under FSDP, and gradcomp's spec of each compressed one.
METHODS = ("noop", "dense", "topk", "twobit")
SPECS = {"topk": "topk:{density}", "twobit": "twobit:chunk"}


def shard(net):
    """``fully_shard`` every child of the model's ``ModuleList``s (transformer blocks), then the model."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for module in list(net.modules()):
        if isinstance(module, nn.ModuleList):
            for child in module:
                fully_shard(child)
    return fully_shard(net)


class _Counted:
    """FSDP's ``ReduceScatter`` for ``dense`` (its own collective, counted) and ``noop`` (no collective)."""

    def __init__(self, counter: dict, communicate: bool):
        self.counter, self.communicate = counter, communicate

    def allocate(self, size, *, dtype, device):
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        import torch.distributed as dist

        nbytes = input_tensor.numel() * input_tensor.element_size()
        self.counter["dense"] += nbytes
        self.counter["sent"] += nbytes if self.communicate else 0
        if self.communicate:
            from gradcomp import inflight

            # Held aliases: Gloo's thread must not be the last owner of a Python tensor at exit.
            sent, received = inflight.hold(input_tensor, output_tensor)
            return dist.reduce_scatter_tensor(received, sent, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
        return None


class Telemetry:
    """Per-step ``bytes_sent``, ``dense_bytes``, ``compress_s`` of a method (gradcomp's from its stats)."""

    def __init__(self, state=None):
        self.state, self.counter = state, {"sent": 0, "dense": 0}

    def end_step(self) -> dict:
        if self.state is not None:
            last = self.state.stats()["last_step"]
            return {"bytes_sent": int(last["bytes_sent"]), "dense_bytes": int(last["dense_bytes"]),
                    "compress_s": float(last["compress_s"])}
        out = {"bytes_sent": self.counter["sent"], "dense_bytes": self.counter["dense"], "compress_s": 0.0}
        self.counter.update(sent=0, dense=0)
        return out


def attach(model, method: str, optimizer, scheduler, steps: int, density: float = 0.01, **residuals):
    """Install ``method`` on the FSDP ``model``; returns ``(Telemetry, what the recipe was given)``."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from gradcomp.hooks import fsdp as gc_fsdp

    if method not in METHODS:
        raise ValueError(f"method {method!r} does not run under FSDP; choose one of {METHODS}")
    if method in ("noop", "dense"):
        telemetry = Telemetry()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(_Counted(telemetry.counter, method == "dense"))
        return telemetry, None
    # AdamW's stage cannot run sharded (register says so): its recipe is the dense start and ramp alone.
    stage = not isinstance(optimizer, torch.optim.Adam)
    state = gc_fsdp.register(model, SPECS[method].format(density=density), optimizer=optimizer if stage else None,
                             total_steps=steps, scheduler=scheduler, **residuals)
    return Telemetry(state), "recipe" if stage else "recipe without its optimizer stage"


class FsdpRun(Run):
    """A run under FSDP2: every block and the model under ``fully_shard``, a method of :data:`METHODS`; the
    workload and loop of a convergence spec (``--study-spec``) or of :mod:`experiments.train`'s arguments."""

    def wrap(self, net):
        return shard(net)

    def attach(self):
        import torch

        job = self.args.job
        telemetry, self.recipe = attach(self.model, job["method"], self.optimizer, self.scheduler,
                                        job.get("planned_steps") or self.loop.steps, job["density"], **job["residuals"])
        self.kernel_warmup_s = 0.0
        if telemetry.state is not None:  # JIT compilation before training, out of the step times (as train does)
            self.kernel_warmup_s = methods.warm_up_kernels(telemetry.state.engine.compressor, None,
                                                           torch.device("cpu"))
        return telemetry

    def config(self, backend: str) -> dict:
        import torch

        from experiments import fingerprint

        job = self.args.job
        return {**job["describe"], "parallel": "fsdp", "engine": "fsdp", "buckets": "fsdp modules",
                "code": fingerprint.code(), "machine": fingerprint.machine(),
                "recipe": self.recipe, "residuals": {k: str(v) for k, v in job["residuals"].items()},
                "world_size": self.world_size, "kernel_warmup_s": self.kernel_warmup_s, "batch_size": self.batch_size,
                "loop": self.loop.describe(), "link": os.environ.get("GRADCOMP_LINK", "unshaped"),
                "torch": torch.__version__, "params": sum(p.numel() for p in self.model.parameters())}

    def held_out_sums(self):
        """Every rank evaluates every window (FSDP's forward is collective, so the ranks must run the same
        number of forwards), all alike."""
        import torch

        return self.workload.evaluate_sums(self.model, 0, 1, torch.device("cpu"))

    def summarize(self, final: dict, train_time: float, step_times: list, losses: list) -> None:
        memory = self.telemetry.state.engine.residual_memory if self.telemetry.state is not None else None
        self.emit({"event": "summary", "method": self.args.job["method"], "steps": self.loop.steps, "parallel": "fsdp",
                   **timing_summary(train_time, step_times, losses),
                   "residual_bytes": memory.nbytes() if memory is not None else 0,
                   "residual_working_peak_bytes": memory.peak_working_bytes if memory is not None else 0, **final})


def run_study(specs, runs_dir: str, args) -> int:
    """Run the convergence study's ``specs`` (:class:`experiments.convergence.RunSpec`) as real FSDP jobs of
    ``args.nproc`` ranks, one after another, unshaped; logs ``<stem>__fsdp.jsonl``. Returns the failures."""
    from experiments.convergence import run_launched

    def command(spec, log_path: str) -> list:
        return [sys.executable, "-m", "experiments.fsdp_train", "--study-spec", json.dumps(asdict(spec)),
                "--log", log_path, "--nproc", str(args.nproc), "--max-time", str(args.run_timeout)]

    return run_launched(specs, runs_dir, "fsdp", METHODS, command, args.run_timeout + 60)

def parse_args(argv=None) -> argparse.Namespace:
    """:func:`experiments.launch.parse_args`'s arguments (``--compressor`` one of :data:`METHODS`), plus
    ``--residual-dtype``, ``--residual-share`` and ``--study-spec`` (a convergence RunSpec as JSON: its
    workload, loop and length replace the others)."""
    import torch

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--residual-dtype", choices=("float32", "bfloat16"), default="float32")
    extra.add_argument("--residual-share", type=float, default=1.0)
    extra.add_argument("--study-spec")
    extra.add_argument("--planned-steps", type=int, help="the recipe's total_steps (default --steps): a longer run "
                       "keeps the final setting, so its step times are the final setting's")
    known, rest = extra.parse_known_args(argv)
    args = launch.parse_args(rest)
    residuals = {"residual_dtype": getattr(torch, known.residual_dtype), "residual_share": known.residual_share}
    if known.study_spec:
        spec = json.loads(known.study_spec)
        args.job = {"method": spec["method"], "density": 0.01, "residuals": residuals, "describe": spec}
        args.suite_spec, args.eval_every = spec, spec["eval_every"]
    else:
        described = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
        args.job = {"method": args.compressor, "density": args.density, "residuals": residuals,
                    "describe": {**described, "planned_steps": known.planned_steps},
                    "planned_steps": known.planned_steps}
    if args.job["method"] not in METHODS:
        raise SystemExit(f"fsdp_train: --compressor {args.job['method']!r} does not run under FSDP; "
                         f"choose one of {METHODS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    launch.set_thread_env(args.threads)
    if args.log:
        os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    return launch.spawn(args, run_rank, FsdpRun)


if __name__ == "__main__":
    sys.exit(main())
