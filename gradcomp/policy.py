"""``Auto``: pick, per group, the fastest of dense, fp16, 2-bit and top-k on the link actually in use.

How it decides. During the dense warm-up steps the engine already allreduces every group dense;
the policy times each of those allreduces (launch to completion, less the time it queued behind
the previous group on the same process group) and knows its bytes. At the first compressed step
the ranks share these measurements (one tiny blocking allgather, in ``Engine.start``, never in a
DDP ``.then``), keep per group the fastest rank's time (the others also waited for stragglers'
backward) and fit the alpha-beta link of :mod:`gradcomp.costmodel` to them. Each group's
candidates are then timed once on its real size on this rank (compress, plus decoding the ``P``
payloads; shared the same way, slowest rank kept) and the group gets the candidate of least
predicted ``comm + compute``; a compressor must beat dense by :attr:`Auto.dense_margin` to be
chosen. Every rank computes the choice from the same gathered integers, so all ranks agree.

A prediction is not a measurement: a choice that compresses anything is then kept only if whole
steps with it are measured ``dense_margin`` faster than dense steps taken in turn with them
(:mod:`gradcomp.step_trial`, ``trial_steps`` pairs). A choice the steps measure no faster takes the
compressors it used out of the running, and after one dense step (it flushes the residuals) every group
is decided again from the candidates left, with a trial of its own; with none left every group goes
dense until the link is found to have changed. On the unshaped loopback of a 2-core machine the model
predicted fp16 and top-k faster (the wire was), and the steps were slower (the CPU that Gloo shares
with backward was not); at 1 Gbit/s top-k's steps were slower than dense's and fp16's faster.
While every group goes dense or through a cast (fp16: no error feedback, nothing held back), an
optimizer stage that can step aside (the recipe's frozen-variance Adam) does, from the next step on,
so that those steps cost what dense training's (or torch's fp16 hook's) do.

Re-decisions: a group first seen later (DDP rebuilt its buckets) is decided when it first appears;
every ``recheck_every`` steps the ranks share how measured exchange times compare with the
predictions, and if the link looks slower or faster by more than ``link_margin`` its bandwidth is
rescaled and every group is decided again; while every group is dense, only if slower, and by enough that
the steps a trial measured for a rejected choice would win (:meth:`~gradcomp.step_trial.StepTrial.would_win`).

Invalid measurements (NaN, infinite or negative, e.g. from a faulty clock or hook) never make one
rank raise inside the policy's collectives: each is shared as "missing" and every rank drops the
same ones. A candidate no rank timed validly is never chosen; a link no rank timed validly raises
the same ``RuntimeError`` on every rank, after the collective.

Use::

    engine = Engine(gradcomp.TopK(0.01), transport, policy=Auto())     # the base compressor only
    # switches compression on after warm-up; the policy picks what each group actually uses.
    state = gc_ddp.register(model, gradcomp.TopK(0.01)); state.engine.policy = Auto()

``stats()["policy"]`` holds the link estimate, each group's choice with predicted and measured
seconds; the choices are logged once per decision.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from gradcomp import costmodel
from gradcomp.compressors import from_spec
from gradcomp.compressors.base import Compressor
from gradcomp.exchanges import average_gathered
from gradcomp.step_trial import StepTrial

__all__ = ["Auto", "DEFAULT_CANDIDATES"]

logger = logging.getLogger(__name__)

# The ternary chunk code (a level per 64 elements from the chunk itself; the recipe's 2-bit where it
# does not run 3-bit, gradcomp.recipe.code): a fixed threshold fits gradients of one known magnitude
# only and sends almost nothing elsewhere. A policy measures each candidate's cost per bucket; which
# code converges best for the run is the recipe's question, not the policy's: under the recipe,
# gradcomp.setup puts the recipe's own 2-bit code (3-bit where it chose it) in this one's place.
DEFAULT_CANDIDATES = ("fp16", "twobit:chunk", "topk:0.01")
_NS = 1e9
_MISSING = -1  # a measurement that was no finite time >= 0, as shared with the other ranks


def _fastest(gathered: torch.Tensor) -> list:
    """Per column of float64 ``[P, F]``, the least valid value (``inf`` where none is valid)."""
    return torch.where(torch.isnan(gathered), math.inf, gathered).min(dim=0).values.tolist()


def _slowest(gathered: torch.Tensor) -> list:
    """Per column of float64 ``[P, F]``, the largest valid value (``inf`` where none is valid)."""
    largest = torch.where(torch.isnan(gathered), -math.inf, gathered).max(dim=0).values
    return torch.where(torch.isinf(largest), math.inf, largest).tolist()


class Auto:
    """The automatic per-group policy held by :class:`gradcomp.engine.Engine` (``policy=``).

    Args:
        candidates: compressor specs to choose from besides dense.
        dense_margin: a compressor is chosen only if predicted at most ``1 - dense_margin`` of
            dense's time (default 0.05: never slower than dense within the model's error).
        link_margin: re-decide when measured/predicted exchange time leaves
            ``[1 / (1 + m), 1 + m]`` (default 0.5).
        recheck_every: steps between those checks (default 100; 0: never).
        trial_steps: pairs of steps (one dense, one compressed, taken in turn, each cycle with a step
            that flushes the residuals) of the measured trial that keeps a choice only if whole steps
            with it are at least ``dense_margin`` faster (default 8; 0: keep what the model predicts,
            unmeasured). See :mod:`gradcomp.step_trial`.
        measurement_hook: for tests: ``hook(kind, group, seconds) -> seconds`` replaces each of
            this rank's own measurements (``kind`` ``"link"``: a warm-up dense allreduce,
            ``"kernel:<spec>"``, ``"exchange"``: a group's exchange after the decision, ``"step"``: a
            whole step, ``group`` then ``"uncompressed"`` or ``"compressed"``) before they are shared, e.g.
            to give ranks different measurements and check they still agree.
    """

    def __init__(self, candidates: Sequence[str] = DEFAULT_CANDIDATES, dense_margin: float = 0.05,
                 link_margin: float = 0.5, recheck_every: int = 100, trial_steps: int = 8,
                 measurement_hook: Optional[Callable[[str, Hashable, float], float]] = None):
        self.candidates: Tuple[Compressor, ...] = tuple(from_spec(s) if isinstance(s, str) else s for s in candidates)
        if not self.candidates:
            raise ValueError("Auto needs at least one candidate compressor besides dense")
        if not 0 <= dense_margin < 1:
            raise ValueError(f"dense_margin must be in [0, 1), got {dense_margin!r}")
        if not link_margin > 0:
            raise ValueError(f"link_margin must be > 0, got {link_margin!r}")
        if recheck_every < 0:
            raise ValueError(f"recheck_every must be >= 0, got {recheck_every!r}")
        if trial_steps < 0:
            raise ValueError(f"trial_steps must be >= 0, got {trial_steps!r}")
        self.dense_margin, self.link_margin, self.recheck_every = dense_margin, link_margin, int(recheck_every)
        self.measurement_hook = measurement_hook
        self.trial_steps = int(trial_steps)
        self._trial = StepTrial(self.trial_steps, dense_margin)
        self._rejected: set = set()  # specs of the choices trials found no faster (until the link changes)
        # The step at which the candidates left are decided; until then (the verdict's step) every group is dense.
        self._retry_at: Optional[int] = None
        self.link: Optional[costmodel.Link] = None
        self.decisions: Dict[Hashable, dict] = {}
        self._chosen: Dict[Hashable, Optional[Compressor]] = {}
        self._kernels: Dict[Tuple[str, int], float] = {}  # (spec, numel) -> agreed seconds
        # Warm-up samples: (group, bytes) -> [(step, seconds)] (DDP's groups change size when it rebuilds).
        self._dense: Dict[Tuple[Hashable, int], List[Tuple[int, float]]] = {}
        self._launched: Dict[Hashable, float] = {}
        self._last_done = 0.0
        self._ratios: List[float] = []
        self._last_check = None
        self._step_seen = -1

    # -- engine calls --------------------------------------------------------------------
    def choose(self, engine, group: Hashable, numel: int, dtype: torch.dtype, device,
               base: Optional[Compressor]) -> Optional[Compressor]:
        """The compressor for ``group`` this step (``None``: dense). Called by ``Engine.start``
        for every group; may run a blocking allgather (the same group on every rank)."""
        new_step = engine.step != self._step_seen
        self._step_seen = engine.step
        if new_step:
            self._trial.new_step(engine.step, self._step_hook if self.measurement_hook else None)
            self._pace_stage(engine.transform)
        chosen = base
        if base is not None and engine.transport is not None and engine.transport.world_size > 1:
            if self.link is None:
                self._agree_link(engine)
            elif new_step:
                self._between_steps(engine)
            if group not in self._chosen or self.decisions[group]["numel"] != numel:  # new or rebuilt
                self._decide(engine, group, numel, dtype, device)
            chosen = self._chosen[group]
            if chosen is not None and self._trial.forces_dense(engine.step):
                chosen = None
            elif chosen is not None and type(chosen) is type(base):
                # The family the cost model picked, at the setting the schedule gives this step (a
                # ramp's density): the choice then runs that compressor's recipe.
                chosen = base
        if chosen is not None and chosen.uses_error_feedback and getattr(engine.transform, "suspended", False):
            chosen = None  # a suspended stage resumes between steps (the next), never inside one
        self._launched[group] = time.perf_counter()
        return chosen

    def _pace_stage(self, stage) -> None:
        """At a step's first group, before anything of it runs: an optimizer stage that can step aside
        (``suspend``/``resume``, :class:`~gradcomp.optim.FrozenVarianceAdam`) does so while every group's
        standing choice is dense, and on a trial's timed dense steps, and comes back once neither holds
        (or nothing is decided yet). Its work around an exchange serves compression only, and would make
        the dense steps slower than dense training. The previous step, all dense, flushed the residuals in
        the stage's units first (a trial's flush step, or the step the verdict went dense). A cast (fp16)
        holds nothing back: it needs the stage no more than dense does."""
        if stage is None or not callable(getattr(stage, "suspend", None)):
            return
        idle = self._all_dense(casts=True) or self._trial.suspends_stage(self._step_seen)  # or the timed dense arm
        if idle and not stage.suspended:
            stage.suspend()
        elif not idle and stage.suspended:
            stage.resume()

    def _all_dense(self, casts: bool = False) -> bool:
        """Whether every group's standing choice is dense (``casts``: or a compressor without error
        feedback); ``False`` while nothing is decided."""
        return bool(self._chosen) and all(choice is None or (casts and not choice.uses_error_feedback)
                                          for choice in self._chosen.values())

    def _between_steps(self, engine) -> None:
        """The checks due at a step's first group (collectives at the same step on every rank)."""
        if self.recheck_every and engine.step - self._last_check >= self.recheck_every:
            self._recheck(engine)
        if self._retry_at == engine.step:  # the step after the verdict flushed the residuals: decide again
            self._retry_at = None
            self._forget_decisions()
        if self._trial.due(engine.step) and not self._trial.judge(lambda v: _slowest(self._gather(engine, v))):
            self._rejected.update(c.spec for c in self._chosen.values() if c is not None)
            left = [c.spec for c in self.candidates if c.spec not in self._rejected]
            logger.info("gradcomp.Auto: steps with %s took %.4gx the dense steps taken in turn with them (median "
                        "%.4g s against %.4g s); every group goes dense%s", sorted(self._rejected),
                        self._trial.verdict["paired_ratio"], self._trial.verdict["compressed_step_s"],
                        self._trial.verdict["dense_step_s"], f", then tries {left}" if left else "")
            # This step goes dense (it flushes what the residuals hold); the next decides from what is left.
            self._retry_at = engine.step + 1 if left else None
            self._forget_decisions()

    def _forget_decisions(self) -> None:
        """Drop every group's choice (each is decided again at its next ``choose``)."""
        self._chosen.clear()
        self.decisions.clear()
        self._ratios.clear()  # they measured the decisions just dropped

    @property
    def deciding(self) -> bool:
        """Whether a trial is running or the candidates left are still to be decided (the same on every rank)."""
        return self._trial.running or self._retry_at is not None

    def finished(self, handle) -> None:
        """Called by ``Engine.finish`` first thing, when ``handle``'s collective has completed."""
        now = time.perf_counter()
        launched = self._launched.pop(handle.group, None)
        if launched is None:
            return
        # Collectives of one process group run one after another: what a group waited for the
        # previous one is not its own time.
        seconds = now - max(launched, self._last_done)
        self._last_done = now
        if handle.exchange.sends_gradient and self.link is None:
            seconds = self._hooked("link", handle.group, seconds)
            key = (handle.group, handle.grad.numel() * handle.grad.element_size())
            self._dense.setdefault(key, []).append((self._step_seen, seconds))
        decision = self.decisions.get(handle.group)
        # Only an exchange of the kind predicted measures the prediction (a trial's dense arm is not).
        if decision is not None and self.link is not None and handle.exchange.name == decision["mode"]:
            seconds = self._hooked("exchange", handle.group, seconds)
            decision["measured_s"] = seconds
            if decision["predicted_comm_s"] > 0:
                self._ratios.append(seconds / decision["predicted_comm_s"])
                del self._ratios[:-256]

    def stats(self) -> dict:
        """``{"link": {"latency_s", "bandwidth_Bps"} or None, "groups": {group: {"choice", "mode",
        "numel", "predicted_s": {choice: s}, "predicted_comm_s", "measured_s"}}, "trial":
        {"dense_step_s", "compressed_step_s", "kept"} or None, "rejected": [spec]}`` (the last measured
        trial, and the candidates trials found no faster on this link)."""
        link = None if self.link is None else {"latency_s": self.link.latency_s, "bandwidth_Bps": self.link.bandwidth}
        return {"link": link, "groups": {g: dict(d) for g, d in self.decisions.items()},
                "trial": None if self._trial.verdict is None else dict(self._trial.verdict),
                "rejected": sorted(self._rejected)}

    def settings(self) -> dict:
        """Every setting that changes what ranks choose (plain values; the cross-rank check hashes
        them): ranks with different margins or recheck intervals would pick different methods or
        run their shared measurements at different steps, and hang. ``measurement_hook`` is a test
        instrument that replaces this rank's own measurements, which differ between ranks anyway."""
        return {"candidates": tuple(c.spec for c in self.candidates), "dense_margin": float(self.dense_margin),
                "link_margin": float(self.link_margin), "recheck_every": self.recheck_every,
                "trial_steps": self.trial_steps}

    def state_dict(self) -> dict:
        return self.settings()

    # -- measurements shared by all ranks -------------------------------------------------
    def _step_hook(self, arm: str, seconds: float) -> float:
        return self._hooked("step", arm, seconds)

    def _hooked(self, kind: str, group: Hashable, seconds: float) -> float:
        return float(self.measurement_hook(kind, group, seconds)) if self.measurement_hook else seconds

    @staticmethod
    def _gather(engine, values: Sequence[float]) -> torch.Tensor:
        """Every rank's ``values`` (seconds, as integer ns so all ranks hold the same numbers): float64
        ``[P, F]``, NaN where a rank's value was not a finite time >= 0.

        An invalid measurement is shared as missing rather than raised here: a rank that raised
        alone would leave the others waiting in this collective. Every rank then drops the same
        missing values (:func:`_fastest`, :func:`_slowest`)."""
        local = torch.tensor([min(int(v * _NS), 2**62) if math.isfinite(v) and v >= 0 else _MISSING
                              for v in (float(v) for v in values)], dtype=torch.int64)
        gathered = engine.transport.agree(local).view(-1, len(values)).to(torch.float64)
        return torch.where(gathered < 0, torch.full_like(gathered, math.nan), gathered / _NS)

    def _agree_link(self, engine) -> None:
        if not self._dense:
            raise RuntimeError("gradcomp.Auto measures the link during dense warm-up steps; use warmup_steps >= 1")
        # The first warm-up step includes set-up costs: use the later ones when there are any.
        first = min(step for samples in self._dense.values() for step, _ in samples)
        later = {key: [t for step, t in samples if step > first] for key, samples in self._dense.items()}
        if any(later.values()):
            samples = {key: times for key, times in later.items() if times}
        else:
            samples = {key: [t for _, t in v] for key, v in self._dense.items()}
        # Collectives may complete in another order on each rank: sort, so column i is one group everywhere.
        keys = sorted(samples, key=lambda key: (repr(key[0]), key[1]))
        times = [statistics.median(samples[key]) for key in keys]
        nbytes = [nb for _, nb in keys]
        fastest = _fastest(self._gather(engine, times))
        valid = [i for i, t in enumerate(fastest) if math.isfinite(t)]
        if not valid:  # the same verdict on every rank: all of them gathered the same values
            raise RuntimeError("gradcomp.Auto: no rank measured a valid link time during warm-up (every "
                               "measurement was NaN, infinite or negative); check the measurement_hook or the "
                               "clock, or pass a fixed compressor without policy=")
        self.link = self._fit(engine.transport.world_size, [nbytes[i] for i in valid], [fastest[i] for i in valid])
        self._last_check = engine.step
        self._dense.clear()

    @staticmethod
    def _fit(world_size: int, nbytes: Sequence[int], seconds: Sequence[float]) -> costmodel.Link:
        """The ring allreduce's ``t = 2(P-1) a + 2(P-1) b / (P B)`` fitted to the samples."""
        p = world_size
        k = 2 * (p - 1)
        if len(set(nbytes)) >= 2:
            mean_b, mean_t = statistics.fmean(nbytes), statistics.fmean(seconds)
            var = sum((b - mean_b) ** 2 for b in nbytes)
            slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(nbytes, seconds)) / var
            intercept = mean_t - slope * mean_b
            if slope > 0 and intercept >= 0:
                return costmodel.Link(intercept / k, k / (p * slope))
        total_s = max(sum(seconds), 1e-9)
        return costmodel.Link(0.0, k * sum(nbytes) / (p * total_s))

    def _kernel_seconds(self, engine, compressor: Compressor, numel: int, dtype, device) -> float:
        """This rank's time to compress ``numel`` elements and decode ``P`` payloads (best of 2)."""
        p = engine.transport.world_size
        grad = torch.randn(numel, dtype=dtype, device=device)
        out = torch.empty(numel, dtype=torch.float32, device=device)
        best = float("inf")
        for _ in range(2):
            started = time.perf_counter()
            if compressor.uses_error_feedback:
                residual_in = torch.zeros(numel, dtype=torch.float32, device=device)
                payload = compressor.compress(grad, residual_in, torch.empty_like(residual_in), backend=engine.backend)
            else:
                payload = compressor.compress(grad, backend=engine.backend)
            if compressor.summable:
                compressor.decompress(payload, out, engine.backend)
            else:
                gathered = payload.buffer.repeat(p)
                average_gathered(compressor, payload.layout, gathered, out, engine.backend)
            best = min(best, time.perf_counter() - started)
        return best

    def _decide(self, engine, group: Hashable, numel: int, dtype, device) -> None:
        exchanges = {c.spec: engine.exchange_for(c, numel, dtype, device) for c in self.candidates}
        usable = [c for c in self.candidates if not exchanges[c.spec].sends_gradient and c.spec not in self._rejected]
        missing = [c for c in usable if (c.spec, numel) not in self._kernels]
        if missing:
            local = [self._hooked(f"kernel:{c.spec}", group, self._kernel_seconds(engine, c, numel, dtype, device))
                     for c in missing]
            slowest = _slowest(self._gather(engine, local))  # inf where no rank measured: never chosen
            self._kernels.update({(c.spec, numel): s for c, s in zip(missing, slowest)})
        cluster = costmodel.Cluster(engine.transport.world_size, self.link)
        # Not compressing is a choice too, named after the exchange that then sends the gradient.
        dense = engine.exchange_for(None, numel, dtype, device)
        cost = dense.cost(None, numel, cluster, costmodel.Kernels(), dtype)
        predicted = {dense.name: (cost.total_s, cost.comm_s, dense.name)}
        for c in usable:
            exchange = exchanges[c.spec]
            cost = exchange.cost(c, numel, cluster, costmodel.Kernels(), dtype)
            predicted[c.spec] = (cost.comm_s + self._kernels[(c.spec, numel)], cost.comm_s, exchange.name)
        best = min((c for c in usable), key=lambda c: predicted[c.spec][0], default=None)
        choice = None
        if (best is not None and self._retry_at is None
                and predicted[best.spec][0] <= (1 - self.dense_margin) * predicted[dense.name][0]):
            choice = best
            self._trial.begin(engine.step)  # kept only if the steps are measured faster
        name = dense.name if choice is None else choice.spec
        self._chosen[group] = choice
        self.decisions[group] = {"choice": name, "mode": predicted[name][2], "numel": int(numel),
                                 "predicted_s": {k: v[0] for k, v in predicted.items()},
                                 "predicted_comm_s": predicted[name][1], "measured_s": None}
        logger.info("gradcomp.Auto: group %r (%d elements) -> %s; predicted %s; link %.3g s + bytes / %.3g B/s",
                    group, numel, name, {k: round(v[0], 6) for k, v in predicted.items()},
                    self.link.latency_s, self.link.bandwidth)

    def _recheck(self, engine) -> None:
        """Share how measured exchange times compare with the predictions; rescale the link and
        decide every group again when they differ by more than ``link_margin`` (while every group is
        dense, only when the link got slower, by enough that a rejected choice's measured steps would win)."""
        self._last_check = engine.step
        local = statistics.median(self._ratios) if self._ratios else 1.0
        self._ratios.clear()
        ratio = _fastest(self._gather(engine, [local]))[0]  # the least-waiting rank, as for the link
        if not math.isfinite(ratio) or ratio <= 0 or 1 / (1 + self.link_margin) <= ratio <= 1 + self.link_margin:
            return
        if self._all_dense() and (ratio < 1 or not self._trial.would_win(
                (ratio - 1) * sum(d["predicted_comm_s"] for d in self.decisions.values()))):
            # A faster link only makes dense better, and one slower by too little to turn the steps a trial
            # measured too: deciding again would buy another trial of slower steps (a noisy CPU swings the
            # exchange's time either way: the main job's unshaped loopback once seemed 1.5x slower).
            return
        logger.info("gradcomp.Auto: exchanges take %.2fx the predicted time; deciding again", ratio)
        self.link = costmodel.Link(self.link.latency_s * ratio, self.link.bandwidth / ratio)
        self._forget_decisions()
        self._rejected, self._retry_at = set(), None  # the trials measured the old link
        self._trial.restart(engine.step)
