"""The engine's checkpoint: one ``state_dict`` format for DDP and Horovod, loaded transactionally.

:func:`state_dict` writes the format below; :func:`prepare_load` validates a saved dict against
the live engine and returns the function that assigns it, so that an adapter that loads more
than the engine (the Horovod optimizer's own state) can validate every part before it assigns
any. A rejected load raises ``ValueError`` and changes nothing.
"""
from __future__ import annotations

import warnings
from typing import Callable, List, Mapping, Optional, Tuple

import torch

from gradcomp.compressors.registry import spec_of
from gradcomp.exchanges import registry as exchange_registry

__all__ = ["STATE_FORMAT", "REQUIRED_KEYS", "MAX_STEP", "state_dict", "prepare_load", "check_float_vector",
           "all_ranks", "own_part"]

#: The version of the state dict's layout (recorded as ``"format"``).
STATE_FORMAT = 1


def state_dict(engine) -> dict:
    """``engine``'s state for this rank (``torch.load(weights_only=True)`` safe):

    ``{"format": 1, "step": int, "world_size": int, "rank": int, "compressor": spec str,
    "schedule": schedule.state_dict(), "transform": transform.state_dict() or None,
    "residuals": {parameter name: float32 1-D tensor on CPU}, "telemetry": stats' totals}``, plus,
    for each exchange of the engine's chain that keeps state, that state under its key (the
    two-phase exchange's second-stage residuals under ``"owner_residuals"``). Residuals are one
    rank's private error: save every rank's state, or all ranks' in one file (:func:`all_ranks`).
    """
    transport = engine.transport
    schedule = engine.schedule
    return {
        "format": STATE_FORMAT,
        "step": engine.step,
        "world_size": transport.world_size if transport is not None else 1,
        "rank": transport.rank if transport is not None else 0,
        "compressor": spec_of(engine.compressor),
        "schedule": schedule.state_dict() if callable(getattr(schedule, "state_dict", None)) else None,
        "transform": engine.transform.state_dict() if engine.transform is not None else None,
        "residuals": engine.residual_memory.state_dict()["residuals"],
        "telemetry": engine.telemetry.totals(),
        **{held.state_key: held.state_dict() for held in engine.exchanges if held.state_key is not None},
    }


#: The keys of :func:`state_dict`'s output; an exchange's state key is written only by an engine that holds it.
REQUIRED_KEYS = ("format", "step", "world_size", "rank", "compressor", "schedule", "transform", "residuals")
#: Keys a checkpoint may lack (written since): the totals of ``stats()``.
OPTIONAL_KEYS = ("telemetry",)
TELEMETRY_KEYS = ("bytes_sent", "dense_bytes", "compress_s", "steps")


def all_ranks(states) -> dict:
    """Every rank's :func:`state_dict` (``states[r]`` of rank ``r``) as one dict, for a loop that saves
    one file from rank 0; :func:`own_part` takes each rank's part back out of it."""
    states = list(states)
    for rank, state in enumerate(states):
        if not isinstance(state, Mapping) or state.get("rank") != rank:
            raise ValueError(f"all_ranks needs every rank's state_dict in rank order; entry {rank} is not "
                             f"rank {rank}'s")
    return {"format": STATE_FORMAT, "ranks": states}


def own_part(saved, rank: int, world_size: int):
    """``saved`` itself, or this rank's part of an :func:`all_ranks` dict. A dict of another world size
    gives rank 0's part, which then loads with zeroed residuals and a warning (see :func:`prepare_load`)."""
    if not isinstance(saved, Mapping) or "ranks" not in saved:
        return saved
    ranks = saved["ranks"]
    if not isinstance(ranks, (list, tuple)) or not ranks or saved.get("format") != STATE_FORMAT:
        raise ValueError("a gradcomp checkpoint of all ranks holds {'format': 1, 'ranks': [state of each rank]}")
    return ranks[rank] if len(ranks) == world_size else ranks[0]
#: The largest step a checkpoint may hold: far beyond any run, and safe in int64 arithmetic.
MAX_STEP = 2**62
MAX_WORLD_SIZE = 2**31


def prepare_load(engine, saved, parameter_numels: Optional[Mapping[str, int]] = None,
                 unknown_residuals: str = "raise") -> Callable[[], None]:
    """Validate :func:`state_dict`'s output against ``engine`` and return the function that assigns it.

    Everything is validated before anything is assigned, and the returned function does not fail
    on a validated dict: every key of :data:`REQUIRED_KEYS` present and no unknown key, ``format``
    this version's, ``step`` in ``[0, MAX_STEP]``, ``world_size``/``rank`` integers in range, every
    residual a 1-D float tensor finite in float32 (the dtype it is stored in) whose numel equals its
    parameter's (``parameter_numels``: name -> numel, where the adapter knows the parameters), the
    schedule's and the transform's state (their ``prepare_load`` or ``load_state_dict`` must raise
    without changing anything when it does not fit) and the exchanges' state. A rejected load raises
    ``ValueError`` and leaves the live state exactly as it was.

    Residuals whose name matches no parameter raise (``unknown_residuals="warn"``: warn and
    drop them). A checkpoint of another world size or rank, or of another compressor
    (``"compressor"`` spec), loads with a warning and zero residuals: each residual is one
    rank's private error of one compressor.
    """
    if unknown_residuals not in ("raise", "warn"):
        raise ValueError(f"unknown_residuals must be 'raise' or 'warn', got {unknown_residuals!r}")
    transport = engine.transport
    here = (transport.world_size, transport.rank) if transport is not None else (1, 0)
    saved = own_part(saved, here[1], here[0])
    step, world_size, rank = _checked_header(saved)
    totals = _checked_totals(saved.get("telemetry"))
    kept = _checked_residuals(saved["residuals"], parameter_numels, unknown_residuals)
    assign_slots = _prepared_slots(engine, saved)
    reset_reason = _reset_reason(engine, saved["compressor"], (world_size, rank), here)
    # Checked even when then dropped: a corrupt checkpoint is rejected, not half-read.
    exchange_states = _prepared_exchanges(engine, saved, world_size, rank)

    def assign() -> None:
        assign_slots()
        engine.step = step
        if totals is not None:
            engine.telemetry.load_totals(totals)
        if reset_reason is not None:
            if kept:
                warnings.warn(f"gradcomp: {reset_reason}; error-feedback residuals are reset to zero")
            engine.residual_memory.reset()
            reset = getattr(engine.transform, "reset", None)
            if reset is not None:  # the stage's per-rank state (first moments) is this rank's alone too
                reset()
        else:
            engine.residual_memory.load_state_dict({"residuals": kept})
        for held, assign_state in exchange_states:
            if assign_state is not None and reset_reason is None:
                assign_state()
            else:
                held.reset()

    return assign


def _reset_reason(engine, saved_spec, saved_at: Tuple[int, int], here: Tuple[int, int]) -> Optional[str]:
    """Why this rank's residuals (and first moments) cannot be the checkpoint's: another rank or
    world size, or another compressor (``None``: they can)."""
    if not isinstance(saved_spec, str):
        raise ValueError(f"'compressor' must be a spec string, got {type(saved_spec).__name__}")
    if saved_at != here:
        return (f"the checkpoint was saved by rank {saved_at[1]} of world size {saved_at[0]} and is loaded by rank "
                f"{here[1]} of world size {here[0]}")
    if saved_spec != spec_of(engine.compressor):
        return f"the checkpoint's residuals were made by {saved_spec!r}, this run uses {spec_of(engine.compressor)!r}"
    return None


def _checked_header(saved) -> Tuple[int, int, int]:
    """``(step, world_size, rank)`` of a saved dict whose keys and format are this version's; raises
    ``ValueError`` otherwise."""
    if not isinstance(saved, Mapping):
        raise ValueError(f"expected the dict from state_dict(), got {type(saved).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in saved]
    if missing:
        raise ValueError(f"state_dict lacks {missing}; pass the dict from state_dict()")
    known = REQUIRED_KEYS + OPTIONAL_KEYS + exchange_registry.state_keys()
    unknown = sorted(str(key) for key in saved if key not in known)
    if unknown:
        raise ValueError(f"state_dict has keys {unknown} that gradcomp does not write; pass the dict from "
                         "state_dict() (the model's and optimizer's states are loaded separately)")
    fmt = saved["format"]
    if fmt != STATE_FORMAT:
        raise ValueError(f"state_dict format {fmt!r} is not the one this version reads ({STATE_FORMAT})")
    step = _int_field(saved, "step", 0, MAX_STEP)
    world_size = _int_field(saved, "world_size", 1, MAX_WORLD_SIZE)
    return step, world_size, _int_field(saved, "rank", 0, world_size - 1)


def _checked_totals(totals) -> Optional[dict]:
    """The saved totals of ``stats()`` (``None``: a checkpoint written before they were saved)."""
    if totals is None:
        return None
    if not isinstance(totals, Mapping) or set(totals) != set(TELEMETRY_KEYS):
        raise ValueError(f"'telemetry' must hold {TELEMETRY_KEYS}, got {totals!r}")
    for key in TELEMETRY_KEYS:
        value = totals[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise ValueError(f"'telemetry' {key!r} must be a finite number >= 0, got {value!r}")
    return dict(totals)


def _prepared_slots(engine, saved) -> Callable[[], None]:
    """Check the saved schedule's and transform's states against the engine's slots (changing
    nothing) and return what assigns the transform's; the schedule's load checks before it changes
    anything, so it is loaded here."""
    saved_schedule = saved["schedule"]
    if saved_schedule is not None and callable(getattr(engine.schedule, "load_state_dict", None)):
        engine.schedule.load_state_dict(saved_schedule)  # checks; raises without changing anything
    saved_transform = saved["transform"]
    if (saved_transform is None) != (engine.transform is None):
        raise ValueError("the checkpoint was saved " + ("without" if saved_transform is None else "with")
                         + " an optimizer-aware transform and this run " + ("has one" if saved_transform is None
                                                                             else "has none"))
    if engine.transform is None:
        return lambda: None
    prepare = getattr(engine.transform, "prepare_load", None)
    if callable(prepare):
        return prepare(saved_transform)  # checks; changes nothing
    # A transform whose load checks everything before it changes anything.
    return lambda: engine.transform.load_state_dict(saved_transform)


def _prepared_exchanges(engine, saved, world_size: int, rank: int) -> List[tuple]:
    """``(exchange, assign or None)`` for each exchange of the engine's chain that keeps state: its
    saved state checked (``None``: nothing saved for it); the state of an exchange this engine does not
    hold is dropped with a warning."""
    held = {exchange.state_key: exchange for exchange in engine.exchanges if exchange.state_key is not None}
    for key in exchange_registry.state_keys():
        if key not in held and saved.get(key):
            cls = exchange_registry.by_state_key(key)
            warnings.warn(f"gradcomp: the checkpoint holds {cls.state_what} of the {cls.label} exchange; "
                          f"this run uses exchange={engine.exchange!r} and drops them")
    return [(exchange, exchange.prepare_load(saved[key], world_size, rank) if saved.get(key) is not None else None)
            for key, exchange in held.items()]


def _checked_residuals(residuals, parameter_numels: Optional[Mapping[str, int]], unknown_residuals: str) -> dict:
    """The residuals to assign, each checked (see :func:`prepare_load`); raises ``ValueError``."""
    if not isinstance(residuals, Mapping):
        raise ValueError(f"'residuals' must be a dict of parameter name -> tensor, got {type(residuals).__name__}")
    kept = {}
    for name, value in residuals.items():
        check_float_vector(value, f"the residual of {name!r}")
        if parameter_numels is not None:
            if name not in parameter_numels:
                if unknown_residuals == "raise":
                    raise ValueError(
                        f"the checkpoint has a residual for {name!r}, which is no parameter of this model "
                        "(pass unknown_residuals='warn' to drop such residuals with a warning)"
                    )
                warnings.warn(f"gradcomp: dropped the residual of {name!r}, which is no parameter of this model")
                continue
            if value.numel() != parameter_numels[name]:
                raise ValueError(f"the residual of {name!r} has {value.numel()} elements but the parameter "
                                 f"has {parameter_numels[name]}; was the model changed?")
        kept[name] = value
    return kept


def check_float_vector(value, what: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a 1-D float tensor finite in float32, the dtype
    gradcomp keeps residuals and velocities in (a float64 1e300 is finite, its float32 is not)."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ""
        raise ValueError(f"{what} must be a 1-D float tensor, got {type(value).__name__}{shape}")
    if not bool(torch.isfinite(value.detach().to(torch.float32)).all()):
        raise ValueError(f"{what} is not finite in float32; the checkpoint is corrupt")


def _int_field(saved, name: str, minimum: int, maximum: int) -> int:
    value = saved[name]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"'{name}' must be an integer in [{minimum}, {maximum}], got {value!r}")
    return value
