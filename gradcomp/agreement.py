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
from typing import Dict, Hashable, Optional, Sequence, Tuple

import torch

from gradcomp.compressors.base import Compressor

__all__ = ["AGREEMENT_FIELDS", "SettingsMismatchError", "settings_fingerprint", "check_agreement", "spec_of"]

logger = logging.getLogger(__name__)

#: What the ranks compare before they exchange anything (see :func:`check_agreement`).
AGREEMENT_FIELDS = ("compressor", "error_feedback", "schedule", "transform", "min_numel", "world_size", "step",
                    "group_numels", "group_dtypes")


class SettingsMismatchError(RuntimeError):
    """Ranks were configured differently; raised on every rank before any gradient is exchanged."""


def _stable_hash(value) -> int:
    """A 63-bit hash of ``repr(value)``, the same in every process (``hash()`` is salted)."""
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def spec_of(compressor: Optional[Compressor]) -> Optional[str]:
    """The compressor's registry spec (``"topk:0.01"``), or its repr where it has none."""
    if compressor is None:
        return None
    spec = getattr(compressor, "spec", None)
    return spec if isinstance(spec, str) else repr(compressor)


def _policy_settings(policy) -> object:
    return policy.state_dict() if callable(getattr(policy, "state_dict", None)) else None


def settings_fingerprint(engine, groups: Sequence[Tuple[Sequence[int], torch.dtype]]) -> Dict[str, object]:
    """The settings every rank must share, by field (:data:`AGREEMENT_FIELDS`); backend-independent.

    Args:
        engine: the :class:`gradcomp.engine.Engine` whose settings are read (not mutated).
        groups: ``(numels, dtype)`` of each group about to be exchanged.
    """
    schedule = engine.schedule.state_dict() if callable(getattr(engine.schedule, "state_dict", None)) else None
    return {
        # How the compressor is chosen and exchanged travels with it: ranks that exchange
        # differently, or where only some run a policy (it adds collectives), would hang.
        "compressor": spec_of(engine.compressor) + ("" if engine.exchange == "allgather"
                                                    else f" exchange={engine.exchange}")
        + ("" if getattr(engine, "granularity", "parameter") == "parameter" else f" granularity={engine.granularity}")
        + ("" if engine.policy is None else f" policy={type(engine.policy).__name__}{_policy_settings(engine.policy)}"),
        "error_feedback": engine.error_feedback and engine.compressor.uses_error_feedback,
        "schedule": (type(engine.schedule).__name__, schedule),
        "transform": None if engine.transform is None else type(engine.transform).__name__,
        "min_numel": engine.min_numel,
        "world_size": engine.transport.world_size if engine.transport is not None else 1,
        "step": engine.step,  # the schedule's position: ranks resumed from different checkpoints differ here
        "group_numels": tuple(tuple(int(n) for n in numels) for numels, _ in groups),
        "group_dtypes": tuple(str(dtype) for _, dtype in groups),
    }


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
            differing.append(f"{name} ({sides}; rank {transport.rank} has {fields[name]!r})")
    if differing:
        place = f" at group {where!r}" if where is not None else ""
        raise SettingsMismatchError(
            f"gradcomp: ranks disagree on {', '.join(differing)}{place}. Every rank must use the same "
            "compressor and settings, model and dtypes; nothing was exchanged."
        )
    if engine.step > 0 and where is not None:
        logger.debug("gradcomp: settings agree across ranks at group %r, step %d", where, engine.step)
