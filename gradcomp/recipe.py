"""The one-call recipe: a compressor's schedule and optimizer stage, derived from the run.

Compression that starts inside the learning-rate warm-up, or error feedback fed into an optimizer
that applies momentum or Adam's normalisation after the exchange, trains measurably worse than
dense (+50% held-out loss for top-k 1% into AdamW on the project's character model). The fixes
are known (DGC's momentum correction, 1-bit Adam's frozen variance, a dense start and a sparsity
ramp), but their constants depend on the run: on a model the project never saw, constants tuned
on one workload ended +23-26% above dense. So :func:`plan` derives every constant from what the
run states:

* **dense start** ``D``: the end of the learning-rate warm-up, read from the LR scheduler (the step
  of its peak learning rate, found by stepping a copy of it); at least ``DENSE_FRACTION`` of the
  run under Adam (whose variance is estimated then frozen) or when no scheduler is given; 2 steps
  at least (DDP rebuilds its buckets after the first). Under SGD-momentum DGC's ramp is the
  warm-up, from step 2, as DGC has it: measured on charlm-small (2000 steps), the same ramp ended
  +1.8% above dense from step 2 and +11% after a dense start to the end of the LR warm-up (step
  20), its loss jumping at the switch.
* **sparsity ramp** (top-k). Under SGD-momentum, DGC's own: densities 1/4, 1/16, 1/64, ... down to
  the final density, each stage ``DENSE_FRACTION`` of the run, with DGC's momentum factor masking
  (measured on charlm-small, SGD-momentum: with masking this ramp stayed within 1-2% of dense;
  without masking it was +46% above dense at step 960, and a ramp from 1/16 +10%). Under Adam and
  other optimizers: densities ``1/16, 1/32, ...`` down to the final density, each stage as long
  as the byte budget allows (``min_compression`` x fewer bytes than dense over the whole run,
  warm-up included; the model's share of parameters sent dense is counted), over at least
  ``RAMP_MIN_FRACTION`` and at most ``RAMP_FRACTION`` of the steps after ``D``. Per byte, moderate
  density early buys more than a longer dense start; a run too short for the budget keeps the
  ramp and says that the budget is missed.
* **optimizer stage**: SGD with momentum hands its momentum (and L2 weight decay) to
  :class:`~gradcomp.optim.DGC`; Adam/AdamW freezes its variance at ``D`` and exchanges its
  momentum in update units, each rank keeping its own momentum (:class:`~gradcomp.optim.FrozenVarianceAdam`,
  ``momentum="local"``: on the GRU ``proselm``, 600 steps, the top-k recipe ended +4.4% above dense
  with it and +12.6% when the sparse average replaced the momentum); anything else gets error
  feedback and the dense start, with a warning that names what is not covered. 2-bit under
  SGD-momentum did not converge with either arrangement measured, so the recipe sends top-k at
  2-bit's bytes instead and says so in a log line.

Every coupled setting (warm-up, freeze step, ramp) is stated here once and derived everywhere
else; :attr:`Plan.summary` says what was chosen, and one log line says it at registration.
"""
from __future__ import annotations

import copy
import logging
import math
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Tuple

import torch

from gradcomp.compressors import Compressor, TopK, TwoBit, from_spec
from gradcomp.schedule import DGC_DENSITIES, DenseWarmup, SparsityRamp
from gradcomp.settings import DEFAULT_MIN_NUMEL, check_compressor

__all__ = ["Plan", "plan", "DENSE_FRACTION", "RAMP_FRACTION", "MIN_COMPRESSION"]

logger = logging.getLogger(__name__)

#: The least share of the run that starts dense (when the LR scheduler's warm-up is shorter or unknown).
DENSE_FRACTION = 0.05
#: The share of the steps after the dense start that the sparsity ramp takes: at least the first
#: (measured on charlm-small, AdamW, 200 steps: a ramp over 1/4 of them ended +3.7% above dense,
#: over 1/2 +2.8%, none +6.3%), at most the second; between them the byte budget decides (over
#: 2000 steps it asks for 0.49, so the 10x budget holds there).
RAMP_MIN_FRACTION = 0.4
RAMP_FRACTION = 0.75
#: The byte budget over the whole run: dense bytes / bytes sent, at least (top-k, 2-bit).
MIN_COMPRESSION = {"topk": 10.0, "twobit": 8.0}
#: First density of the ramp; each next stage halves it.
RAMP_START = 1 / 16
#: The top-k density that sends 2-bit's bytes (values and int32 indices: 2 x density x 4 bytes =
#: 1/16 of float32); the recipe's stand-in for 2-bit where 2-bit does not converge.
TWOBIT_BYTES_DENSITY = 1 / 32


@dataclass
class Plan:
    """What :func:`plan` chose for a run; ``schedule`` and ``transform`` go to the engine."""

    compressor: Compressor
    total_steps: int
    dense_steps: int
    schedule: object
    transform: object = None
    optimizer_stage: str = "error feedback"
    expected_compression: float = 1.0
    notes: Sequence[str] = field(default_factory=tuple)
    #: Compressor classes that do not converge with this optimizer stage (a policy must not pick them).
    unsuited: Tuple[type, ...] = ()

    @property
    def summary(self) -> str:
        ramp = ""
        if isinstance(self.schedule, SparsityRamp):
            stages = self.schedule.stages(self.compressor)
            ramp = f", ramp {'/'.join(f'{d:.4g}' for d in stages)} x {self.schedule.stage_steps} steps"
        return (f"{self.compressor!r} with {self.optimizer_stage}: {self.dense_steps} dense steps of "
                f"{self.total_steps}{ramp}; about {self.expected_compression:.1f}x fewer bytes than dense")


def lr_peak_step(scheduler, total_steps: int) -> int:
    """The first step at which ``scheduler``'s learning rate (group 0) reaches its maximum over
    ``total_steps``, found on a copy (the parameters are shared, not copied; nothing of
    ``scheduler`` or its optimizer changes)."""
    optimizer = scheduler.optimizer
    memo = {id(p): p for group in optimizer.param_groups for p in group["params"]}
    memo.update({id(t): t for state in optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor)})
    probe = copy.deepcopy(scheduler, memo)
    best_lr, best_step = float(probe.optimizer.param_groups[0]["lr"]), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": nothing is trained here
        for step in range(1, total_steps):
            probe.step()
            lr = float(probe.optimizer.param_groups[0]["lr"])
            if lr > best_lr * (1 + 1e-9):
                best_lr, best_step = lr, step
    return best_step


def dense_share(named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], min_numel: int) -> float:
    """The share of elements in parameters under ``min_numel``, which travel dense inside payloads."""
    sizes = [p.numel() for _, p in named_parameters if p.requires_grad]
    total = sum(sizes)
    return sum(n for n in sizes if n < min_numel) / total if total else 0.0


def _bytes_per_element(compressor: Compressor, density: Optional[float], dense: float) -> float:
    """Bytes sent per element as a share of dense float32 (values + int32 indices for top-k)."""
    if isinstance(compressor, TopK):
        compressed = 2.0 * (density if density is not None else compressor.density)
    else:
        compressed = 1 / 16
    return dense + (1 - dense) * compressed


def _dgc_ramp(compressor: TopK, total: int) -> Tuple[Tuple[float, ...], int]:
    """DGC's own warm-up for its momentum correction: sparsity 75%, 93.75%, 98.4%, ... (density / 4
    each stage) down to the final density, each stage ``DENSE_FRACTION`` of the run."""
    densities = tuple(d for d in DGC_DENSITIES if d > compressor.density * (1 + 1e-9))
    return densities, (max(1, math.ceil(DENSE_FRACTION * total)) if densities else 0)


def _ramp(compressor: TopK, total: int, dense_steps: int, budget: float, dense: float) -> Tuple[Tuple[float, ...], int]:
    """The ramp's densities and stage length that fit ``budget`` (a share of dense bytes)."""
    final = compressor.density
    densities, d = [], RAMP_START
    while d > final * (1 + 1e-9) and len(densities) < 8:
        densities.append(d)
        d /= 2
    if not densities:
        return (), 0
    rest = total - dense_steps
    c_final = _bytes_per_element(compressor, final, dense)
    spare = budget * total - dense_steps - rest * c_final  # bytes (in dense steps) the ramp may spend
    extra = sum(_bytes_per_element(compressor, d, dense) - c_final for d in densities)
    stage = int(spare / extra) if spare > 0 else 0
    shortest, longest = (int(fraction * rest / len(densities)) for fraction in (RAMP_MIN_FRACTION, RAMP_FRACTION))
    stage = min(max(stage, shortest), longest)
    return (tuple(densities), stage) if stage >= 1 else ((), 0)


def plan(compressor, optimizer=None, total_steps: Optional[int] = None, scheduler=None,
         named_parameters: Sequence[Tuple[str, torch.nn.Parameter]] = (), min_numel: int = DEFAULT_MIN_NUMEL,
         min_compression: Optional[float] = None, step_hook: bool = True) -> Plan:
    """Derive the schedule and the optimizer stage of ``compressor`` for this run.

    Args:
        compressor: a compressor or its spec (``"topk:0.01"``, ``"twobit:rms"``).
        optimizer: the user's optimizer. SGD with momentum is changed in place (momentum and
            weight decay move into the DGC stage, for top-k); Adam/AdamW gets a step pre-hook
            (:class:`~gradcomp.optim.FrozenVarianceAdam`).
        total_steps: optimizer steps in the run (required).
        scheduler: the LR scheduler, if any: its warm-up sets the dense start.
        named_parameters: ``(name, parameter)`` of the module DDP wraps (the stage's keys).
        min_numel: parameters under it travel dense (their share counts against the budget).
        min_compression: the byte budget, dense bytes / bytes sent over the run (default
            :data:`MIN_COMPRESSION` of the compressor's family).
        step_hook: how an Adam stage reaches the optimizer's step (see
            :class:`~gradcomp.optim.FrozenVarianceAdam`): a pre-hook (DDP), or the integration calls it.
    """
    compressor = check_compressor(from_spec(compressor) if isinstance(compressor, str) else compressor)
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"the recipe needs total_steps=<optimizer steps in the run> (an integer >= 1), "
                         f"got {total_steps!r}")
    named = list(named_parameters)
    notes = []
    if isinstance(compressor, TwoBit) and _sgd_momentum(optimizer):
        # Measured on charlm-small (2000 steps): 2-bit under SGD-momentum ended +53% above dense with
        # DGC's velocity and +55% with error feedback into SGD's own momentum, its gap growing all
        # along; top-k at the same bytes ended +1.1%. The recipe picks the compressor that converges.
        replacement = TopK(TWOBIT_BYTES_DENSITY)
        logger.warning("gradcomp recipe: 2-bit does not converge under SGD with momentum (measured +53-55%% "
                       "held-out loss); using %r, which sends as many bytes", replacement)
        compressor = replacement
    family = "topk" if isinstance(compressor, TopK) else "twobit" if isinstance(compressor, TwoBit) else None
    warmup_end = lr_peak_step(scheduler, total_steps) if scheduler is not None else 0
    # Adam's frozen variance is estimated during the dense start, and an unknown LR schedule may
    # hide a warm-up: then at least DENSE_FRACTION of the run; otherwise the warm-up itself. DGC's
    # ramp is its own warm-up and starts at once (after DDP's bucket rebuild).
    estimate = scheduler is None or isinstance(optimizer, torch.optim.Adam)
    floor = math.ceil(DENSE_FRACTION * total_steps) if estimate else 0
    dense_steps = min(total_steps, max(2, warmup_end, floor))
    if _sgd_momentum(optimizer) and isinstance(compressor, TopK):
        dense_steps = min(total_steps, 2)
    if family is None:  # casts: no residual, no recipe needed beyond DDP's rebuild
        return Plan(compressor, total_steps, 2, DenseWarmup(2), None, "no error feedback (a cast)",
                    notes=("casts need no recipe",))
    dense = dense_share(named, min_numel)
    budget = 1 / (min_compression or MIN_COMPRESSION[family])
    if family == "topk":
        dgc = _sgd_momentum(optimizer)
        densities, stage = (_dgc_ramp(compressor, total_steps) if dgc
                            else _ramp(compressor, total_steps, dense_steps, budget, dense))
        schedule = (SparsityRamp(dense_steps, stage, densities) if stage
                    else DenseWarmup(dense_steps))
        ramp_bytes = sum(stage * _bytes_per_element(compressor, d, dense) for d in densities)
        ramp_steps = stage * len(densities)
    else:
        schedule, ramp_bytes, ramp_steps = DenseWarmup(dense_steps), 0.0, 0
    rest = total_steps - dense_steps - ramp_steps
    sent = dense_steps + ramp_bytes + rest * _bytes_per_element(compressor, None, dense)
    expected = total_steps / sent
    if expected * 1.001 < 1 / budget:
        notes.append(f"the dense start ({dense_steps} steps) and the ramp of this {total_steps}-step run leave "
                     f"{expected:.1f}x fewer bytes, under the {1 / budget:.0f}x asked")

    transform, stage_name = None, "error feedback"
    if optimizer is not None:
        transform, stage_name = _optimizer_stage(optimizer, compressor, named, dense_steps, notes, step_hook)
    from gradcomp.optim import DGC

    unsuited = (TwoBit,) if isinstance(transform, DGC) else ()
    result = Plan(compressor, total_steps, dense_steps, schedule, transform, stage_name, expected, tuple(notes),
                  unsuited)
    logger.info("gradcomp recipe: %s", result.summary)
    for note in notes:
        warnings.warn(f"gradcomp recipe: {note}")
    return result


def _sgd_momentum(optimizer) -> bool:
    return isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups)


def _optimizer_stage(optimizer, compressor, named, dense_steps: int, notes: list, step_hook: bool = True):
    """The transform for ``optimizer`` (changing the optimizer where the stage takes its momentum)."""
    from gradcomp.optim import DGC, FrozenVarianceAdam

    if isinstance(optimizer, torch.optim.Adam):
        stage = FrozenVarianceAdam(optimizer, named, freeze_step=dense_steps, units="update", momentum="local",
                                   step_hook=step_hook)
        return stage, (f"frozen-variance {type(optimizer).__name__} (freeze at step {dense_steps}, each rank's "
                       "momentum sent in update units)")
    if isinstance(optimizer, torch.optim.SGD):
        groups = optimizer.param_groups
        momenta = {float(g.get("momentum", 0.0)) for g in groups}
        if momenta == {0.0}:
            return None, "error feedback into SGD"
        if any(g.get("nesterov") or g.get("dampening", 0) for g in groups):
            raise ValueError("the recipe's DGC stage implements SGD momentum without nesterov or dampening; create "
                             "the optimizer with nesterov=False, dampening=0, or register without optimizer=")
        if len(momenta) > 1 or len({float(g.get("weight_decay", 0.0)) for g in groups}) > 1:
            raise ValueError("the recipe moves SGD's momentum and weight decay into gradcomp, which needs one value "
                             "of each across param groups; got several")
        momentum, weight_decay = momenta.pop(), float(groups[0].get("weight_decay", 0.0))
        for group in groups:
            group["momentum"], group["weight_decay"] = 0.0, 0.0
        logger.info("gradcomp recipe: SGD's momentum %s and weight decay %s now live in gradcomp's DGC stage; the "
                    "optimizer runs without them", momentum, weight_decay)
        return DGC(named, momentum=momentum, optimizer=optimizer, masking=True, weight_decay=weight_decay), \
            f"DGC momentum correction (momentum {momentum}, factor masking)"
    notes.append(f"{type(optimizer).__name__} has no optimizer-aware stage: plain error feedback with "
                 f"{dense_steps} dense steps; SGD(momentum) and Adam/AdamW have recipes")
    return None, "error feedback"
