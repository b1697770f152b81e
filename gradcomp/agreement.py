"""The cross-rank settings check: every rank compares a fingerprint of its settings before exchanging.

Ranks configured differently would otherwise send payloads of different sizes (a Gloo abort or
a hang), run different collectives (a hang) or decode each other's bytes with the wrong
settings (a silent divergence). The engine calls :func:`check_agreement` at the first step it
runs and at the step after DDP's bucket rebuild; it costs one allgather of
``len(AGREEMENT_FIELDS)`` int64 per check.

Each field is a 63-bit hash of the ``repr`` of plain values (:func:`settings_fingerprint`), so
a differing field can be named in the error on every rank.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Dict, Hashable, Sequence, Tuple

import torch

from gradcomp.compressors.registry import spec_of

__all__ = ["AGREEMENT_FIELDS", "SettingsMismatchError", "settings_fingerprint", "check_agreement", "slot_settings",
           "exchange_settings"]

logger = logging.getLogger(__name__)

#: What the ranks compare before they exchange anything (see :func:`check_agreement`). The
#: slots (compressor, exchange, policy, schedule, transform) each contribute their own
#: ``settings()``, so a setting added to a slot is covered without a change here.
AGREEMENT_FIELDS = ("compressor", "exchange", "policy", "error_feedback", "schedule", "transform", "min_numel",
                    "world_size", "step", "group_numels", "group_dtypes")


class SettingsMismatchError(RuntimeError):
    """Ranks were configured differently; raised on every rank before any gradient is exchanged."""


def _stable_hash(value) -> int:
    """A 63-bit hash of ``repr(value)``, the same in every process (``hash()`` is salted)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def slot_settings(slot) -> object:
    """A slot's settings as plain values: ``slot.settings()`` where it has one, else its
    ``state_dict()``, else its class name (a slot without either states no settings)."""
    if slot is None:
        return None
    for method in ("settings", "state_dict"):
        if callable(getattr(slot, method, None)):
            return (type(slot).__name__, getattr(slot, method)())
    return type(slot).__name__


def settings_fingerprint(engine, groups: Sequence[Tuple[Sequence[int], torch.dtype]]) -> Dict[str, object]:
    """The settings every rank must share, by field (:data:`AGREEMENT_FIELDS`); backend-independent.

    Args:
        engine: the :class:`gradcomp.engine.Engine` whose settings are read (not mutated).
        groups: ``(numels, dtype)`` of each group about to be exchanged.
    """
    return {
        # Whether compression is per parameter or per bucket changes every payload's size.
        "compressor": (spec_of(engine.compressor), getattr(engine, "granularity", None)),
        # Ranks that exchange differently, or where only some run a policy (it adds collectives), would hang.
        "exchange": exchange_settings(engine),
        "policy": slot_settings(engine.policy),
        "error_feedback": _feedback_settings(engine),
        "schedule": slot_settings(engine.schedule),
        "transform": slot_settings(engine.transform),
        "min_numel": engine.min_numel,
        "world_size": engine.transport.world_size if engine.transport is not None else 1,
        "step": engine.step,  # the schedule's position: ranks resumed from different checkpoints differ here
        "group_numels": tuple(tuple(int(n) for n in numels) for numels, _ in groups),
        "group_dtypes": tuple(str(dtype) for _, dtype in groups),
    }


def _feedback_settings(engine) -> object:
    """Whether residuals are kept, with how a residual memory that states settings stores them (FSDP's
    :class:`~gradcomp.compact_residuals.CompactResiduals`: its dtype changes what a rank sends)."""
    kept = engine.error_feedback and engine.compressor.uses_error_feedback
    decay = getattr(engine, "residual_decay", 1.0)
    kept = (kept, decay) if kept and decay != 1.0 else kept  # plain error feedback hashes as before
    stated = getattr(engine.residual_memory, "settings", None)
    return (kept, stated()) if callable(stated) else kept


def exchange_settings(engine) -> object:
    """The engine's exchange name, with the settings of the exchanges in its chain that state any
    (``Exchange.settings()`` not ``None``): ``name`` alone when none does."""
    stated = tuple((held.name, held.settings()) for held in engine.exchanges if held.settings() is not None)
    return (engine.exchange, stated) if stated else engine.exchange


def _shown(value, limit: int = 600) -> str:
    """``repr(value)``, cut to ``limit`` characters (a transform's settings list every parameter)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...)"


def check_agreement(engine, groups: Sequence[Tuple[Sequence[int], torch.dtype]], where: Hashable = None) -> None:
    """Compare ``engine``'s settings fingerprint across ranks with one tiny allgather (blocking).

    Raises :class:`SettingsMismatchError` on every rank, naming each differing setting,
    which ranks hold which variant and this rank's value. Call it at the same point on
    every rank (the engine does so at the groups of its ``agreement_steps``). Mutates only
    the engine's telemetry (the bytes of the check).
    """
    transport = engine.transport
    if transport is None or transport.world_size == 1:
        return
    fields = settings_fingerprint(engine, groups)
    local = torch.tensor([_stable_hash(fields[name]) for name in AGREEMENT_FIELDS], dtype=torch.int64)
    gathered = transport.agree(local).view(-1, len(AGREEMENT_FIELDS))
    engine.telemetry.record_agreement(local.numel() * local.element_size())
    differing = []
    for column, name in enumerate(AGREEMENT_FIELDS):
        values = gathered[:, column].tolist()
        if len(set(values)) > 1:
            variants: Dict[int, list] = {}
            for rank, value in enumerate(values):
                variants.setdefault(value, []).append(rank)
            sides = " vs ".join(f"ranks {ranks}" for ranks in variants.values())
            differing.append(f"{name} ({sides}; rank {transport.rank} has {_shown(fields[name])})")
    if differing:
        place = f" at group {where!r}" if where is not None else ""
        raise SettingsMismatchError(
            f"gradcomp: ranks disagree on {', '.join(differing)}{place}. Every rank must use the same "
            "compressor and settings, model and dtypes; nothing was exchanged."
        )
    if engine.step > 0 and where is not None:
        logger.debug("gradcomp: settings agree across ranks at group %r, step %d", where, engine.step)
