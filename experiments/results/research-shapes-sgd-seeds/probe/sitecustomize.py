"""Probes of the recipes on shapes under SGD-momentum, loaded into every run's process through ``PYTHONPATH``.

Not gradcomp: each variable changes one thing of the one-call recipe for a research run (README beside this
directory), and nothing when unset::

    GC_TAIL=N     every step from N on dense (the engine flushes the residuals into the first of them)
    GC_HEAD=N     every step before N dense (the plan's own schedule after it)
    GC_DECAY=X    3-bit's residual decay under SGD (the recipe's RESIDUAL_DECAY, 0.9) set to X
    GC_NODELAY=1  top-k's momentum not shortened on compressed steps (DelayedMomentumSGD's delay 0)
    GC_GRANULARITY=G  the engine's granularity the plan asks for set to G ("parameter": top-k per parameter)
    GC_TRACE=DIR  each group's averaged gradient and residual norms at every step, to DIR/trace-PID.jsonl
    GC_MEASURED=min|raw  top-k's momentum shortened by the delay the residual measures (Little's law: the
                  residual's L1 mass over the gradient's per step, each averaged by GC_MEASURED_EMA, 0.9): min,
                  the smaller of it and the density's delay; raw, it alone (GC_MEASURED_LOG=DIR: W per step);
                  GC_MEASURED_AGREED=1: one W for all the simulated ranks of the run (their masses pooled in one
                  average, GC_MEASURED_WORLD ranks a step), as ranks that sum the two masses would share;
                  GC_MEASURED_RAMP=1: the measured delay only where the density is above DELAY_DENSITY, the
                  density's delay at or below it (the recipe's final top-k, 2 % compact, is above it: no change)
    GC_INVERSE=C  the delay given up at density rho is min(DELAY_STEPS, C / rho) (Little's law for top-k: a coordinate
                  of the typical size waits about 1 / rho steps to rank among the top rho share) in place of
                  delay_at's logarithmic law; C = 0.085 matches the residual's W in shapes' ramp stages;
                  GC_INVERSE_EMA=A: that delay followed through an exponential average (A per compressed step,
                  from its first value), as the measured W lags a stage's change of density
    GC_COSLOG=DIR  log, at every SGD step, the cosine between the gradient the step reads (.grad, the average) and the
                  one it read before, with its norm and the rate, to DIR/cos-PID.jsonl (one optimizer of each process: rank 0)
    GC_NOSTABLE=1  top-k's momentum shortened by the density's delay alone, also where the learning rate has
                  fallen below its peak (DelayedMomentumSGD's stable_delay gives up more there)
    GC_PEAKFREE=1  top-k's momentum not shortened at the peak learning rate (k = 1 there), shortened below it as
                  far as the step's answer to a new gradient, k * lr, stays within the peak's lr (plain SGD by a
                  tenth of it)
    GC_CALM=Z     top-k's momentum shortened only while the averaged gradient is calm: a step whose norm passes the
                  running mean by Z standard deviations (ZClip's averages, alpha 0.97) takes the optimizer's own
                  momentum for GC_CALM_HOLD (20) steps (every rank sees the same average: the ranks agree)
    GC_DENSE_MOMENTUM=B  the study's SGD-momentum loops with momentum B and the peak rate times (1 - B) / (1 - m): every
                  step, dense ones too, answers new gradients as the top-k stage's do, at the same steady state
    GC_KCAP=K     top-k's momentum shortened at the peak rate by at most (1 + m) (1 - 1 / K) steps, m = beta / (1 - beta):
                  a compressed step answers a new gradient at most K times as hard as the optimizer's own step
                  (k = (1 + m) / (1 + m - D) <= K); K = 2 is the constant's own k at momentum 0.9 and top-k 1 %, so
                  the study's loops do not change; below the peak, stable_delay as before. GC_SHARE=1 instead: the
                  delay given up is delay_at's times m / 9 (a constant share of the momentum's own memory; the
                  recipe's own, min(1, m / 9), once gradcomp has memory_share: then a no-op)
    GC_CONSTANT=1  SGD's stage gives up delay_at's steps whatever the momentum (the recipe before memory_share:
                  every momentum below 0.9 gives up the steps screened at 0.9)
    GC_SHARPLOG=DIR  log, at every SGD step, the curvature along the last step (a secant: <g_t - g_t-1, p_t - p_t-1> /
                  |p_t - p_t-1|^2, from the averaged gradient and the parameters every rank holds alike) times the
                  rate, over SGD-momentum's stability bound 2 (1 + beta), to DIR/sharp-PID.jsonl (rank 0's optimizer)
    GC_CRITICAL=ETA  Accordion: a window of GC_CRITICAL_WINDOW (10) steps dense whenever the averaged gradient's
                  mean norm over the last window moved by ETA or more of the window's before
    GC_CATCHUP=1  top-k's momentum not shortened; instead each coordinate that reaches the average after waiting
                  `a` steps (steps since it was last nonzero in the average: the same on every rank) is applied as
                  dense SGD-momentum would have applied `a` equal gradients of ages 1..a by now: the buffer takes
                  r S1 / a, the parameter moves lr r (S2 - S1) / a beyond the buffer's step, S1 = (1 - beta^a) /
                  (1 - beta), S2 = (a - beta S1) / (1 - beta) (a = 1: the optimizer's own step)
"""
import os

if os.environ.get("GC_TAIL") or os.environ.get("GC_HEAD"):
    import gradcomp.schedule as schedule

    tail, head = int(os.environ.get("GC_TAIL") or 1 << 62), int(os.environ.get("GC_HEAD") or 0)
    planned = schedule.PlannedSchedule.compressor_at

    def compressor_at(self, step, base):
        return None if step >= tail or step < head else planned(self, step, base)

    schedule.PlannedSchedule.compressor_at = compressor_at
if os.environ.get("GC_DECAY"):
    import gradcomp.recipe as recipe

    recipe.RESIDUAL_DECAY = float(os.environ["GC_DECAY"])
if os.environ.get("GC_NODELAY"):
    import gradcomp.optim.delayed_momentum as delayed

    init = delayed.DelayedMomentumSGD.__init__

    def undelayed(self, optimizer, named_parameters, delay_steps=0.0, step_hook=True):
        init(self, optimizer, named_parameters, 0.0, step_hook)

    delayed.DelayedMomentumSGD.__init__ = undelayed
if os.environ.get("GC_GRANULARITY"):
    import gradcomp.recipe as recipe_granularity

    recipe_granularity._granularity = lambda optimizer, compressor: os.environ["GC_GRANULARITY"]
if os.environ.get("GC_TRACE"):
    import json

    import gradcomp.engine as engine_module

    commit = engine_module.Engine._commit
    trace = open(os.path.join(os.environ["GC_TRACE"], f"trace-{os.getpid()}.jsonl"), "a")

    def traced(self, context, handle, average):
        commit(self, context, handle, average)
        squares = [float(r.float().pow(2).sum()) for r in map(self.residual_memory.residual, handle.keys)
                   if r is not None]
        trace.write(json.dumps({"engine": id(self), "step": self.step, "group": str(handle.group),
                                "average": float(average.float().norm()), "residual": sum(squares) ** 0.5,
                                "compressor": repr(handle.compressor)}) + "\n")

    engine_module.Engine._commit = traced
if os.environ.get("GC_MEASURED"):
    # DelayedMomentumSGD's delay: the smaller of the density's (delay_at) and the one the residual measures,
    # Little's law per group: W = (EMA of the residual's L1 mass) / (EMA of the gradient's L1 mass per step).
    # GC_MEASURED=min: min(delay_at, W); GC_MEASURED=raw: W itself (capped at the momentum's own m by stable_delay).
    import json

    import gradcomp.engine as measured_engine
    import gradcomp.optim.delayed_momentum as measured

    mode, smooth = os.environ["GC_MEASURED"], float(os.environ.get("GC_MEASURED_EMA", "0.9"))
    stage_class = measured.DelayedMomentumSGD
    log = (open(os.path.join(os.environ["GC_MEASURED_LOG"], f"delay-{os.getpid()}.jsonl"), "a")
           if os.environ.get("GC_MEASURED_LOG") else None)
    original_before, original_commit = stage_class.before_compress, measured_engine.Engine._commit
    original_step, original_delay_at = stage_class.before_optimizer_step, measured.delay_at
    agreed = {"ema": {}, "wait": {}} if os.environ.get("GC_MEASURED_AGREED") else None
    ramp_only = bool(os.environ.get("GC_MEASURED_RAMP"))
    if agreed is not None:  # every simulated rank's commit updates one average: per update, smooth ** (1 / world)
        smooth = smooth ** (1.0 / int(os.environ.get("GC_MEASURED_WORLD", "2")))

    def before_compress(self, keys, numels, grad, compressor):
        self.__dict__.setdefault("_arrival", {})[tuple(keys)] = float(grad.abs().sum())
        return original_before(self, keys, numels, grad, compressor)

    def commit(self, context, handle, average):
        original_commit(self, context, handle, average)
        stage = self.transform
        if not isinstance(stage, stage_class) or handle.exchange.sends_gradient:
            return
        keys = tuple(handle.keys)
        arrival = stage.__dict__.get("_arrival", {}).pop(keys, None)
        if arrival is None:
            return
        held = sum(float(r.abs().sum()) for r in map(self.residual_memory.residual, keys) if r is not None)
        ema = agreed["ema"] if agreed is not None else stage.__dict__.setdefault("_ema", {})
        old_held, old_arrival = ema.get(keys, (held, arrival))
        ema[keys] = (smooth * old_held + (1 - smooth) * held, smooth * old_arrival + (1 - smooth) * arrival)
        wait = ema[keys][0] / max(ema[keys][1], 1e-30)
        for key in keys:
            (agreed["wait"] if agreed is not None else stage.__dict__.setdefault("_wait", {}))[key] = wait
        if log is not None:
            log.write(json.dumps({"step": self.step, "group": str(handle.group), "held": held, "arrival": arrival,
                                  "wait": wait}) + "\n")

    def before_optimizer_step(self):
        # delay_at is called once per density in the original; per parameter the wait differs, so the step
        # runs once per distinct wait with the density's delay replaced by the chosen one.
        waits = agreed["wait"] if agreed is not None else self.__dict__.get("_wait", {})
        compressed = dict(self._compressed)
        by_delay = {}
        for key, density in compressed.items():
            full = original_delay_at(density, self.delay_steps)
            wait = waits.get(key, full)
            delay = min(full, wait) if mode == "min" else wait
            if ramp_only and density <= measured.DELAY_DENSITY:
                delay = full
            by_delay.setdefault(round(delay, 6), {})[key] = density
        for delay, part in by_delay.items():
            self._compressed = dict(part)
            measured.delay_at = lambda density, steps=None, d=delay: d
            cleared = []
            try:
                original_step(self)
                cleared = self._cleared
            finally:
                measured.delay_at = original_delay_at
            self.__dict__.setdefault("_all_cleared", []).extend(cleared)
        if not by_delay:
            original_step(self)
        self._cleared, self.__dict__["_all_cleared"] = self.__dict__.get("_all_cleared", []), []

    stage_class.before_compress = before_compress
    stage_class.before_optimizer_step = before_optimizer_step
    measured_engine.Engine._commit = commit
if os.environ.get("GC_INVERSE"):
    import gradcomp.optim.delayed_momentum as inverse

    inverse_c = float(os.environ["GC_INVERSE"])

    def inverse_delay_at(density, delay_steps=inverse.DELAY_STEPS):
        return min(delay_steps, inverse_c / density) if 0 < density < 1 else 0.0

    inverse.delay_at = inverse_delay_at
    if os.environ.get("GC_INVERSE_EMA"):
        inverse_smooth, inverse_step = float(os.environ["GC_INVERSE_EMA"]), inverse.DelayedMomentumSGD.before_optimizer_step

        def lagged_before_optimizer_step(self):
            densities = [d for d in self._compressed.values() if 0 < d < 1]
            if not densities:
                return inverse_step(self)
            target = inverse_delay_at(min(densities), self.delay_steps)
            old = self.__dict__.get("_lagged")
            self._lagged = target if old is None else inverse_smooth * old + (1 - inverse_smooth) * target
            inverse.delay_at = lambda density, delay_steps=None, d=self._lagged: d if 0 < density < 1 else 0.0
            try:
                return inverse_step(self)
            finally:
                inverse.delay_at = inverse_delay_at

        inverse.DelayedMomentumSGD.before_optimizer_step = lagged_before_optimizer_step
if os.environ.get("GC_NOSTABLE"):
    # DelayedMomentumSGD gives up the density's delay at every rate, not more as the rate falls below its peak.
    import gradcomp.optim.delayed_momentum as unstable

    unstable.stable_delay = lambda delay, beta, rate_ratio: max(0.0, delay)
if os.environ.get("GC_CRITICAL"):
    # Accordion's critical regimes, read from the averaged gradient: every GC_CRITICAL_WINDOW steps (10) the mean
    # norm of the window is compared with the previous window's; a relative change of GC_CRITICAL (e.g. 0.5) or more
    # sends the next window dense. Signals are per process (each simulated rank sees the same averages).
    import gradcomp.engine as critical_engine
    import gradcomp.schedule as critical_schedule

    eta, window = float(os.environ["GC_CRITICAL"]), int(os.environ.get("GC_CRITICAL_WINDOW", "10"))
    state = {"sums": {}, "means": [], "dense_until": -1, "windows_dense": 0}
    critical_commit, critical_at = critical_engine.Engine._commit, critical_schedule.PlannedSchedule.compressor_at

    def critical_commit_traced(self, context, handle, average):
        critical_commit(self, context, handle, average)
        if self is not getattr(critical_engine, "_critical_first", None):
            if getattr(critical_engine, "_critical_first", None) is None:
                critical_engine._critical_first = self
            else:
                return  # one engine (rank 0) feeds the signal; the ranks' averages are alike
        step = self.step
        state["sums"][step] = state["sums"].get(step, 0.0) + float(average.float().pow(2).sum())

    def critical_compressor_at(self, step, base):
        planned = critical_at(self, step, base)
        if step > 0 and step % window == 0 and state.get("decided") != step:  # once a step, whoever asks
            state["decided"] = step
            steps = sorted(s for s in state["sums"] if step - window <= s < step)
            if steps:
                mean = sum(state["sums"][s] ** 0.5 for s in steps) / len(steps)
                if state["means"] and abs(mean - state["means"][-1]) / max(state["means"][-1], 1e-30) >= eta:
                    state["dense_until"] = step + window
                state["means"].append(mean)
        return None if planned is not None and step < state["dense_until"] else planned

    critical_engine.Engine._commit = critical_commit_traced
    critical_schedule.PlannedSchedule.compressor_at = critical_compressor_at
if os.environ.get("GC_PEAKFREE"):
    # stable_delay with nothing given up at the peak: D = (1 + m) (1 - 1 / rate_ratio), at most m, on compressed steps.
    import gradcomp.optim.delayed_momentum as peakfree

    def peak_free_delay(delay, beta, rate_ratio):
        if delay <= 0 or beta <= 0 or rate_ratio <= 1:
            return 0.0
        m = beta / (1.0 - beta)
        return min(m, (1.0 + m) * (1.0 - 1.0 / rate_ratio))

    peakfree.stable_delay = peak_free_delay
if os.environ.get("GC_CALM"):
    import json
    import math as calm_math

    import gradcomp.optim.delayed_momentum as calm

    z_limit, hold_steps = float(os.environ["GC_CALM"]), int(os.environ.get("GC_CALM_HOLD", "20"))
    calm_step = calm.DelayedMomentumSGD.before_optimizer_step
    calm_log = (open(os.path.join(os.environ["GC_CALM_LOG"], f"calm-{os.getpid()}.jsonl"), "a")
                if os.environ.get("GC_CALM_LOG") else None)

    def calm_before_optimizer_step(self):
        import torch

        state = self.__dict__.setdefault("_calm", {"mean": None, "var": 0.0, "seen": 0, "hold": 0, "calls": 0})
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = float(torch.stack(torch._foreach_norm(grads)).square().sum().sqrt()) if grads else 0.0
        state["calls"] += 1
        spike = False
        if state["mean"] is None:
            state["mean"] = norm
        else:
            limit = state["mean"] + z_limit * calm_math.sqrt(state["var"])
            spike = state["seen"] >= 10 and norm > limit
            r = min(norm, limit) if state["seen"] >= 10 else norm
            state["var"] = 0.97 * state["var"] + 0.03 * (r - state["mean"]) ** 2
            state["mean"] = 0.97 * state["mean"] + 0.03 * r
            state["seen"] += 1
        if spike:
            state["hold"] = hold_steps
        held = state["hold"] > 0 and bool(self._compressed)
        if calm_log is not None:
            calm_log.write(json.dumps({"call": state["calls"], "norm": norm, "spike": spike, "held": held}) + "\n")
        if state["hold"] > 0:
            state["hold"] -= 1
            self._compressed.clear()  # the optimizer's own step: the user's momentum, undelayed
        return calm_step(self)

    calm.DelayedMomentumSGD.before_optimizer_step = calm_before_optimizer_step


def log_first_sgd_steps(directory, prefix, record):
    """Wrap torch's ``SGD.step``: before each step of the process's first SGD optimizer (rank 0's), from its second
    on, write ``{"call": n, **record(param_group, now, before)}`` to ``directory/prefix-PID.jsonl``; ``now`` and
    ``before`` are ``(gradient, parameters)`` of this step and the one before, flat float64 copies."""
    import json

    import torch

    log = open(os.path.join(directory, f"{prefix}-{os.getpid()}.jsonl"), "a")
    state, step = {"owner": None, "previous": None, "calls": 0}, torch.optim.SGD.step

    def logged_step(self, *args, **kwargs):
        if state["owner"] is None:
            state["owner"] = id(self)
        if state["owner"] == id(self):
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            if params:
                now = (torch.cat([p.grad.reshape(-1) for p in params]).double(),
                       torch.cat([p.detach().reshape(-1) for p in params]).double())
                before = state["previous"]
                if before is not None and before[0].numel() == now[0].numel():
                    log.write(json.dumps({"call": state["calls"], **record(self.param_groups[0], now, before)}) + "\n")
                state["previous"] = now
            state["calls"] += 1
        return step(self, *args, **kwargs)

    torch.optim.SGD.step = logged_step


if os.environ.get("GC_COSLOG"):
    def cosine(group, now, before):
        dot, norm, previous = float(now[0] @ before[0]), float(now[0].norm()), float(before[0].norm())
        return {"cos": dot / max(norm * previous, 1e-30), "norm": norm, "lr": group["lr"]}

    log_first_sgd_steps(os.environ["GC_COSLOG"], "cos", cosine)
dense_loops = None
if os.environ.get("GC_DENSE_MOMENTUM"):
    try:  # the study's orchestrating process starts before the repository is on its path; it trains nothing
        import experiments.loop as dense_loops
    except ModuleNotFoundError:
        pass
if dense_loops is not None:
    from dataclasses import replace as dense_replace

    dense_beta, dense_loop_for = float(os.environ["GC_DENSE_MOMENTUM"]), dense_loops.loop_for

    def shorter_loop_for(workload, optimizer, steps, **overrides):
        loop = dense_loop_for(workload, optimizer, steps, **overrides)
        if optimizer != "sgdm":
            return loop
        return dense_replace(loop, momentum=dense_beta, lr=loop.lr * (1 - dense_beta) / (1 - loop.momentum))

    dense_loops.loop_for = shorter_loop_for
if os.environ.get("GC_KCAP") or os.environ.get("GC_SHARE"):
    import gradcomp.optim.delayed_momentum as capped

    capped_stable, kcap = capped.stable_delay, float(os.environ.get("GC_KCAP") or 0)
    share = bool(os.environ.get("GC_SHARE")) and not hasattr(capped, "memory_share")  # the recipe's own since

    def capped_stable_delay(delay, beta, rate_ratio):
        m = beta / (1.0 - beta) if 0 < beta < 1 else 0.0
        if share:
            delay = delay * m / 9.0
        if kcap:
            delay = min(delay, (1.0 + m) * (1.0 - 1.0 / kcap))
        return capped_stable(delay, beta, rate_ratio)

    capped.stable_delay = capped_stable_delay
if os.environ.get("GC_CONSTANT"):
    import gradcomp.optim.delayed_momentum as constant

    constant.memory_share = lambda beta: 1.0 if 0 < beta < 1 else 0.0
if os.environ.get("GC_SHARPLOG"):
    def secant(group, now, before):
        dg, dp = now[0] - before[0], now[1] - before[1]
        move = float(dp @ dp)
        curvature = float(dg @ dp) / move if move > 0 else 0.0
        return {"curvature": curvature, "lr": group["lr"],
                "edge": group["lr"] * curvature / (2 * (1 + group["momentum"]))}

    log_first_sgd_steps(os.environ["GC_SHARPLOG"], "sharp", secant)
if os.environ.get("GC_CATCHUP"):
    import torch

    import gradcomp.optim.delayed_momentum as catchup

    @torch.no_grad()
    def catchup_before_optimizer_step(self):
        compressed = {id(self.names[key]) for key, density in self._compressed.items()
                      if key in self.names and 0 < density < 1}
        self._compressed.clear()
        self._cleared = []
        ages = self.__dict__.setdefault("_ages", {})
        for group in self.optimizer.param_groups:
            beta, lr, wd = float(group["momentum"]), float(group["lr"]), group["weight_decay"]
            if beta <= 0:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) not in compressed:  # a dense step sends every coordinate: nothing waits
                    ages.pop(id(p), None)
                    continue
                r = -p.grad if group.get("maximize") else p.grad
                a = ages.get(id(p), torch.zeros_like(p, dtype=torch.float32)) + 1
                s1 = (1 - torch.pow(beta, a)) / (1 - beta)
                s2 = (a - beta * s1) / (1 - beta)
                d = r * (s1 / a) * (1 - group["dampening"])
                if wd:
                    d = d.add(p, alpha=wd)
                state = self.optimizer.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    state["momentum_buffer"] = buf = d.clone()
                else:
                    buf.mul_(beta).add_(d)
                p.add_(buf, alpha=-lr)
                p.add_(r * ((s2 - s1) / a), alpha=-lr)
                ages[id(p)] = torch.where(r != 0, torch.zeros_like(a), a)
                self._cleared.append((p, p.grad))
                p.grad = None

    catchup.DelayedMomentumSGD.before_optimizer_step = catchup_before_optimizer_step
