"""Saving and loading :class:`~gradcomp.optim.FrozenVarianceAdam`'s state: every part validated before any is
assigned."""
from __future__ import annotations

import torch

__all__ = ["prepare_load", "state_dict"]


def state_dict(stage) -> dict:
    """``stage``'s (a ``FrozenVarianceAdam``) settings, suspension, freeze and refresh steps, gate, guard and
    levels, and with ``exchange="momentum"`` this rank's first moments (CPU float32 copies), with ``"gradient"``
    the waits of the catch-up (CPU int16, the same on every rank)."""
    state = {**stage._recipe(), "suspended": stage.suspended, "frozen_at": stage.frozen_at,
             "refreshed_at": stage.refreshed_at,
             "gate": stage.gate.state_dict(), "guard": stage.guard.state_dict() if stage.guard else None,
             "level": stage.level.state_dict() if stage.level else None}
    if stage.exchange == "momentum":
        state["moments"] = {k: v.detach().cpu().clone() for k, v in stage.moments.items()}
    else:
        state["waits"] = stage.catch_up.state_dict()
    return state


def prepare_load(stage, state_dict: dict):
    """Validate ``stage.state_dict()``'s output for ``stage`` (a ``FrozenVarianceAdam``) and return the function
    that assigns it (mutating ``stage``: its moments, waits, suspension, freeze step, gate, guard and levels).
    Raises ``ValueError``, changing nothing. A state saved before the waits existed loads with none: each held-back
    coordinate's next burst is taken as one step old."""
    if not isinstance(state_dict, dict):
        raise ValueError(f"expected FrozenVarianceAdam.state_dict(), got {type(state_dict).__name__}")
    saved = dict(state_dict)
    moments, waits = saved.pop("moments", {}), saved.pop("waits", {})
    suspended, frozen_at = saved.pop("suspended", False), saved.pop("frozen_at", None)
    refreshed_at = saved.pop("refreshed_at", None)  # saved before the refreshes: none since the freeze
    saved.setdefault("delay_steps", stage.delay_steps)  # saved before these settings existed: any run's fits
    saved.setdefault("bounded", stage.bounded)
    saved.setdefault("latest_freeze", None)
    saved.setdefault("spike_guard", stage.guard is not None)
    saved.setdefault("live_level", stage.level is not None)
    saved.setdefault("refresh", stage.refresh)
    gate, guard, level = saved.pop("gate", {}), saved.pop("guard", None), saved.pop("level", None)
    steps = (frozen_at, refreshed_at)
    if not isinstance(suspended, bool) or not all(s is None or (type(s) is int and s >= 1) for s in steps):
        raise ValueError(f"the checkpoint's FrozenVarianceAdam has suspended={suspended!r}, frozen_at={frozen_at!r}, "
                         f"refreshed_at={refreshed_at!r}; expected a bool and None or a step >= 1 each")
    if saved != stage._recipe():
        raise ValueError(f"the checkpoint's FrozenVarianceAdam settings {saved} differ from this run's "
                         f"{stage._recipe()}")
    if not isinstance(gate, dict):
        raise ValueError(f"the checkpoint's freeze gate is not a dict, got {type(gate).__name__}")
    assign_gate = stage.gate.prepare_load(gate)
    assign_guard = stage.guard.prepare_load(guard) if stage.guard and guard is not None else (lambda: None)
    # saved before the levels existed: they start again from the denominators at the next frozen step
    groups = len(stage.optimizer.param_groups)
    assign_level = stage.level.prepare_load(level if level is not None else {}, groups) if stage.level else None
    assign_waits = stage.catch_up.prepare_load(waits, stage.names, "FrozenVarianceAdam")
    if not isinstance(moments, dict):
        raise ValueError("the checkpoint's first moments are not a dict of tensors by parameter name")
    checked = {}
    for key, moment in moments.items():
        param = stage.names.get(key)
        if param is None or not isinstance(moment, torch.Tensor) or moment.numel() != param.numel():
            raise ValueError(f"the checkpoint's first moment of {key!r} fits no parameter of this model")
        moment = moment.reshape(-1).to(device=param.device, dtype=torch.float32)
        if not bool(torch.isfinite(moment).all()):  # in float32: a float64 1e300 is not finite here
            raise ValueError(f"the checkpoint's first moment of {key!r} is not finite")
        checked[key] = moment

    def assign() -> None:
        stage.moments, stage.suspended = checked, suspended
        stage.frozen_at, stage.refreshed_at = frozen_at, refreshed_at
        assign_gate()
        assign_guard()
        assign_waits()
        if assign_level is not None:
            assign_level()
        stage._pending.clear()

    return assign
