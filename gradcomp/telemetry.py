"""Telemetry of the exchanges: bytes handed to collectives and time spent compressing.

One :class:`Telemetry` serves both integrations, so ``stats()`` has one shape on DDP and
Horovod alike. A *group* is what the engine exchanges in one collective: a DDP bucket
(named by its index) or a Horovod parameter or parameter group (named by its parameter
names).
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional

from gradcomp.exchanges import registry as exchange_registry

__all__ = ["Telemetry"]

#: The exchange names seen registered (a cache of the registry's, read at every record).
_KNOWN_MODES = set()

_SUMMED = ("bytes_sent", "dense_bytes", "compress_s")


class Telemetry:
    """Per-step and total counters of one engine. Mutated only by the engine and adapters."""

    __slots__ = ("step", "_current", "_last", "_totals", "_agreement")

    def __init__(self):
        self.step = 0
        self._current: Dict[Hashable, dict] = {}
        self._last: Dict[Hashable, dict] = {}
        self._totals = {"bytes_sent": 0, "dense_bytes": 0, "compress_s": 0.0, "steps": 0}
        # The cross-rank settings check: tiny collectives at set-up and bucket rebuilds only.
        self._agreement = {"collectives": 0, "bytes_sent": 0}

    def record(self, group: Hashable, bytes_sent: int, dense_bytes: int, compress_s: float, mode: str,
               backend: Optional[str] = None) -> None:
        """Count one group's exchange in the current step; ``mode`` is how it travelled, the name of a
        registered exchange (:mod:`gradcomp.exchanges`)."""
        if mode not in _KNOWN_MODES:
            _KNOWN_MODES.update(exchange_registry.names())  # an exchange registered since
            if mode not in _KNOWN_MODES:
                raise ValueError(f"unknown mode {mode!r}; modes are {exchange_registry.names()}")
        self._current[group] = {"bytes_sent": int(bytes_sent), "dense_bytes": int(dense_bytes),
                                "compress_s": float(compress_s), "mode": mode, "backend": backend}
        self._totals["bytes_sent"] += int(bytes_sent)
        self._totals["dense_bytes"] += int(dense_bytes)
        self._totals["compress_s"] += float(compress_s)

    def record_agreement(self, nbytes: int) -> None:
        """Count one settings-fingerprint collective of ``nbytes`` bytes from this rank."""
        self._agreement["collectives"] += 1
        self._agreement["bytes_sent"] += int(nbytes)

    def end_step(self) -> None:
        self._last, self._current = self._current, {}
        self._totals["steps"] += 1
        self.step += 1

    @staticmethod
    def _summary(parts: dict) -> dict:
        sent, dense = parts["bytes_sent"], parts["dense_bytes"]
        return {**parts, "compression_ratio": dense / sent if sent else float("nan")}

    def stats(self) -> dict:
        """Bytes this rank handed to collectives and time spent compressing.

        Returns ``{"step": int, "last_step": {...}, "total": {...}, "agreement": {...}}``.
        ``last_step`` and ``total`` have ``bytes_sent``, ``dense_bytes`` (what a dense
        allreduce of the same gradients would hand over), ``compression_ratio`` (dense ÷ sent)
        and ``compress_s``; ``total`` also has ``steps``.
        ``last_step["groups"]`` is ``{group: {"bytes_sent", "dense_bytes", "compress_s", "mode",
        "backend"}}`` with ``mode`` the name of the exchange that carried the group (one of
        ``gradcomp.exchanges.names()``) and ``backend`` the kernel backend that
        compressed the group (``None`` when no kernel ran). ``agreement`` counts the settings
        checks between ranks: ``{"collectives", "bytes_sent"}`` (not in the totals above).
        """
        last = self._last
        last_totals = {key: sum(s[key] for s in last.values()) for key in _SUMMED}
        return {
            "step": self.step,
            "last_step": {**self._summary(last_totals), "groups": {g: dict(s) for g, s in last.items()}},
            "total": self._summary(dict(self._totals)),
            "agreement": dict(self._agreement),
        }

    def totals(self) -> dict:
        """The run's totals (``bytes_sent``, ``dense_bytes``, ``compress_s``, ``steps``), for a checkpoint."""
        return dict(self._totals)

    def load_totals(self, totals: dict) -> None:
        """Continue the totals of a checkpoint (:meth:`totals`), so that ``stats()`` survives a resume."""
        self._totals = {key: type(self._totals[key])(totals[key]) for key in self._totals}

    def __getstate__(self):
        return {slot: getattr(self, slot) for slot in self.__slots__}

    def __setstate__(self, state):
        for slot, value in state.items():
            setattr(self, slot, value)
