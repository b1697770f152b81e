"""Probes of the frozen variance (not gradcomp; imported where this directory is on PYTHONPATH). Every state is the
stage's own: the convergence study simulates each rank with its own stage in one process.

GC_DENSE_FRACTION=F, GC_MIN_COMPRESSION=B: the recipe's Adam dense start and byte budget.
GC_NOLEVEL=1: the stage without its live level.
GC_REFRESH=K (or GC_REFRESH_WEIGHT=W: K the steps over which the run's b2 forgets W of the variance,
``ceil(ln(1 - W) / ln(b2))``, b2 of the first param group): every K optimizer steps after the freeze the variance
takes a sample ``g`` as Adam would have over the K steps, ``v = b2^K v + (1 - b2^K) g^2``, and the denominators
freeze again from it at that step (the live level restarts from them). The sample (GC_REFRESH_SOURCE):
``raw`` (default): the ranks' own gradients before any compression (what ``Engine.start`` receives), averaged over
the ranks: a dense exchange every K steps would deliver it; ``average``: the step's averaged ``.grad``, what the
compressed exchange delivered (no extra bytes).
GC_REFRESH_RELEASED=1 (``average`` source): where the stage holds waits (a sparsifier's), only the coordinates
released this step take the sample, each burst over its wait, ``(g / a)^2`` with ``a = w + 1``; the others keep v.
GC_REFRESH_MOMENT=1 (``average`` source): where the stage holds no waits (a quantizer's), the sample is the first
moment's square, ``exp_avg^2`` before this step (a 2-bit average's own square overstates a small coordinate's).
GC_REFRESH_RESIDUALS=1: at a refresh each residual (kept in the old update units) is rescaled to the new ones.
"""
import math
import os

import torch

import gradcomp.recipe as recipe
from gradcomp import engine as engine_module
from gradcomp.optim import frozen_adam

if os.environ.get("GC_DENSE_FRACTION"):
    recipe.ADAM_DENSE_FRACTION = float(os.environ["GC_DENSE_FRACTION"])
if os.environ.get("GC_MIN_COMPRESSION"):
    for family in recipe.MIN_COMPRESSION:
        recipe.MIN_COMPRESSION[family] = float(os.environ["GC_MIN_COMPRESSION"])

if os.environ.get("GC_NOLEVEL"):
    _init = frozen_adam.FrozenVarianceAdam.__init__

    def _init_nolevel(self, *args, **kwargs):
        kwargs["live_level"] = False
        _init(self, *args, **kwargs)

    frozen_adam.FrozenVarianceAdam.__init__ = _init_nolevel

if os.environ.get("GC_REFRESH") or os.environ.get("GC_REFRESH_WEIGHT"):
    RAW = os.environ.get("GC_REFRESH_SOURCE", "raw") == "raw"
    RESIDUALS = bool(os.environ.get("GC_REFRESH_RESIDUALS"))
    RELEASED = bool(os.environ.get("GC_REFRESH_RELEASED"))
    MOMENT = bool(os.environ.get("GC_REFRESH_MOMENT"))
    SAMPLES = {}  # engine step -> key -> [sum of the ranks' raw gradients, ranks]: every rank's engine adds
    ENGINES = {}  # id(stage) -> its engine (the one whose start saw its keys)
    _start = engine_module.Engine.start

    def _every(stage) -> int:
        if os.environ.get("GC_REFRESH"):
            return int(os.environ["GC_REFRESH"])
        beta2 = stage.optimizer.param_groups[0]["betas"][1]
        return max(1, math.ceil(math.log(1 - float(os.environ["GC_REFRESH_WEIGHT"])) / math.log(beta2)))

    def start(self, grad, keys, numels, group):
        if RAW:
            step, offset = SAMPLES.setdefault(self.step, {}), 0
            for key, n in zip(keys, numels):
                piece = grad[offset: offset + int(n)].detach().float()
                held = step.get(key)
                step[key] = [piece.clone(), 1] if held is None else [held[0] + piece, held[1] + 1]
                offset += int(n)
            for old in [s for s in SAMPLES if s < self.step - 2]:
                del SAMPLES[old]
        self._probe_keys = set(keys) | getattr(self, "_probe_keys", set())
        return _start(self, grad, keys, numels, group)

    engine_module.Engine.start = start
    _before = frozen_adam.FrozenVarianceAdam.before_optimizer_step

    _engine_init = engine_module.Engine.__init__

    def engine_init(self, *args, **kwargs):
        _engine_init(self, *args, **kwargs)
        ENGINES.setdefault("all", []).append(self)

    engine_module.Engine.__init__ = engine_init

    @torch.no_grad()
    def before(self):
        clock = self.__dict__.setdefault("_probe", {"steps": 0, "last": None, "engine": None})
        frozen = any(self.frozen(p) for p in self.names.values())
        if frozen and clock["last"] is None:
            clock["last"] = clock["steps"]
        if clock["engine"] is None and RAW:  # this stage's engine: the one created last before it ran, unclaimed
            claimed = {id(c["engine"]) for c in CLAIMS}
            candidates = [e for e in ENGINES.get("all", []) if id(e) not in claimed
                          and set(self.names) <= getattr(e, "_probe_keys", set())]
            if candidates:
                clock["engine"] = candidates[-1]
                CLAIMS.append(clock)
        if frozen and clock["steps"] - clock["last"] + 1 >= _every(self):
            samples = None
            if RAW and clock["engine"] is not None:
                held = SAMPLES.get(clock["engine"].step) or SAMPLES.get(clock["engine"].step - 1) or {}
                samples = {key: total / ranks for key, (total, ranks) in held.items()}
            old, k = {}, clock["steps"] - clock["last"] + 1
            for group in self.optimizer.param_groups:
                beta2 = group["betas"][1]
                for key, p in self.names.items():
                    if not any(p is q for q in group["params"]):
                        continue
                    state = self.optimizer.state[p]
                    if RAW:
                        grad = samples.get(key) if samples else None
                        grad = grad.view_as(p) if grad is not None else None
                    else:
                        grad = p.grad
                    waits = self.catch_up.waits.get(key) if RELEASED and not RAW else None
                    if MOMENT and not RAW and key not in self.catch_up.waits and "exp_avg" in state:
                        grad = state["exp_avg"]
                    if waits is not None and grad is not None:  # released coordinates only, each over its wait
                        released = grad != 0
                        sample = (grad / (waits.to(grad.dtype) + 1)).square()
                        mixed = state["exp_avg_sq"] * beta2 ** k + (1 - beta2 ** k) * sample
                        state["exp_avg_sq"].copy_(torch.where(released, mixed, state["exp_avg_sq"]))
                    else:
                        state["exp_avg_sq"].mul_(beta2 ** k)
                        if grad is not None:
                            state["exp_avg_sq"].addcmul_(grad, grad, value=1 - beta2 ** k)
                    old[key] = (group, state.pop("frozen_denom", None))
            self.refreshed = getattr(self, "refreshed", 0) + 1
            self.frozen_at = max(self._steps_done(p) for p in self.names.values()) + 1
            if RESIDUALS and clock["engine"] is not None:
                for key, p in self.names.items():
                    residual = clock["engine"].residual_memory.residual(key)
                    group, before_d = old.get(key, (None, None))
                    if residual is not None and before_d is not None:
                        residual.view_as(p).mul_(before_d / self._denom(p, group))
            if self.level is not None:
                self.level.reset()
            self.divisors.clear()
            clock["last"] = clock["steps"] + 1
        _before(self)
        clock["steps"] += 1

    CLAIMS = []
    frozen_adam.FrozenVarianceAdam.before_optimizer_step = before
