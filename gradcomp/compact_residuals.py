"""Residual memory for sharded training: only the committed residuals are kept between exchanges.

Under FSDP every rank's residual covers the whole unsharded gradient: the largest state a rank keeps,
larger than its shard of the parameters, gradients and Adam's moments together from 3 ranks on. The
engine's :class:`~gradcomp.error_feedback.ErrorFeedback` keeps two float32 buffers per group (the
committed residual and the spare the kernel writes ``e'`` into), 8 bytes per element, so that a DDP
bucket's commit is a swap decided later on the device. :class:`CompactResiduals` keeps one copy in
the storage dtype and makes the float32 working pair only while a group is exchanged, one FSDP module
at a time (FSDP reduce-scatters module by module):

================  ==============================  ======================================================
``storage``       bytes per rank between steps    what it costs
================  ==============================  ======================================================
``float32``       4 x elements                    nothing: bitwise the error feedback of the engine
``bfloat16``      2 x elements                    each committed residual is rounded to bfloat16
                                                  (8 bits of mantissa); the rounding error is dropped
``min_numel=T``   4 (or 2) x elements of the      pieces under ``T`` elements keep no residual: the
                  pieces of ``T`` elements or     exchange sends them dense inside the payload, whose
                  more                            error is then zero (more bytes on the wire)
================  ==============================  ======================================================

Plus, while one group is exchanged, 8 bytes per element of that group (its float32 ``e`` and ``e'``).
The interface is the one the engine and :mod:`gradcomp.checkpoint` use: ``buffers``, ``commit``,
``flush_into``, ``residual``, ``drop``, ``keys``, ``reset``, ``state_dict``, ``load_state_dict``.
"""
from __future__ import annotations

import warnings
from typing import Dict, Hashable, List, Sequence, Tuple, Union

import torch

__all__ = ["CompactResiduals", "STORAGE_DTYPES"]

#: The dtypes residuals may be stored in between exchanges.
STORAGE_DTYPES = (torch.float32, torch.bfloat16)


class CompactResiduals:
    """Residuals keyed by caller-given keys (a parameter's piece), stored in ``storage`` between exchanges.

    Args:
        storage: ``torch.float32`` or ``torch.bfloat16``.
        min_numel: keys of fewer elements keep no residual (their ``e'`` is dropped at the commit; the
            exchange sends such pieces dense, so it is zero).

    Mutated by :meth:`buffers` (a working pair is made), :meth:`commit`, :meth:`flush_into`, :meth:`drop`,
    :meth:`reset` and :meth:`load_state_dict`.
    """

    def __init__(self, storage: torch.dtype = torch.float32, min_numel: int = 0):
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"residual storage must be one of {STORAGE_DTYPES}, got {storage!r}")
        if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 0:
            raise ValueError(f"min_numel must be an integer >= 0, got {min_numel!r}")
        self.storage, self.min_numel = storage, min_numel
        self._stored: Dict[Hashable, torch.Tensor] = {}
        # keys of a group being exchanged -> (their numels, e, e'): float32, laid out like the group.
        self._working: Dict[Tuple[Hashable, ...], Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor]] = {}
        #: The most bytes one group's working pair took (what a rank holds on top of :meth:`nbytes` while a
        #: group is exchanged).
        self.peak_working_bytes = 0

    def settings(self) -> dict:
        """What ranks compare before exchanging (:mod:`gradcomp.agreement`)."""
        return {"storage": str(self.storage), "min_numel": self.min_numel}

    def keeps(self, numel: int) -> bool:
        """Whether a key of ``numel`` elements keeps a residual."""
        return numel >= self.min_numel

    def buffers(self, keys: Sequence[Hashable], numels: Sequence[int], device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``(e, e')`` of ``keys`` laid out in that order: ``e`` the committed residuals (zero for a key
        without one), ``e'`` uninitialised for the kernel. Both live until :meth:`commit` of these keys."""
        numels = tuple(int(n) for n in numels)
        residual = torch.zeros(sum(numels), dtype=torch.float32, device=device)
        offset = 0
        for key, numel in zip(keys, numels):
            held = self._stored.get(key)
            if held is not None:
                if held.numel() != numel:
                    raise ValueError(f"the residual of {key!r} has {held.numel()} elements but its gradient has "
                                     f"{numel}; was the model or the world size changed after it was saved?")
                residual[offset: offset + numel].copy_(held)
            offset += numel
        spare = torch.empty_like(residual)
        self._working[tuple(keys)] = (numels, residual, spare)
        self.peak_working_bytes = max(self.peak_working_bytes, 2 * residual.numel() * residual.element_size())
        return residual, spare

    def commit(self, keys: Sequence[Hashable], accept: Union[bool, torch.Tensor] = True, decay: float = 1.0) -> None:
        """Store ``e'`` of ``keys`` (those that keep a residual), times ``decay``, if ``accept``; free the
        working pair either way.
        ``accept`` is read now (a device tensor synchronises: the FSDP path decides on the host already)."""
        numels, _, spare = self._working.pop(tuple(keys))
        if not bool(accept):
            return
        if decay != 1.0:
            spare.mul_(decay)
        offset = 0
        for key, numel in zip(keys, numels):
            piece = spare[offset: offset + numel]
            held = self._stored.get(key)
            if not self.keeps(numel):
                self._stored.pop(key, None)  # a loaded residual went out with this step's payload
            elif held is None or held.device != piece.device:
                self._stored[key] = piece.to(self.storage, copy=True)
            else:
                held.copy_(piece)  # rounds to nearest in bfloat16
            offset += numel

    def flush_into(self, keys: Sequence[Hashable], numels: Sequence[int], grad: torch.Tensor) -> List[Hashable]:
        """Add the residuals held for ``keys`` into the flat ``grad`` (mutated) and forget them (a dense step
        sends them); returns the keys that held one."""
        offset, flushed = 0, []
        for key, numel in zip(keys, numels):
            held = self._stored.pop(key, None)
            if held is not None:
                if held.numel() != numel:
                    raise RuntimeError(f"the residual of {key!r} has {held.numel()} elements, its gradient {numel}")
                grad[offset: offset + numel].add_(held.to(device=grad.device, dtype=grad.dtype))
                flushed.append(key)
            offset += numel
        return flushed

    def residual(self, key: Hashable):
        """The committed residual of ``key`` in the storage dtype (``None`` if it has none)."""
        return self._stored.get(key)

    def drop(self, keys: Sequence[Hashable]) -> None:
        for key in keys:
            self._stored.pop(key, None)

    def keys(self) -> List[Hashable]:
        return list(self._stored)

    def nbytes(self) -> int:
        """Bytes the committed residuals take (what a rank keeps between steps)."""
        return sum(t.numel() * t.element_size() for t in self._stored.values())

    def reset(self) -> None:
        self._stored.clear()
        self._working.clear()

    def state_dict(self) -> Dict[str, Dict[Hashable, torch.Tensor]]:
        """``{"residuals": {key: 1-D tensor on CPU, in the storage dtype}}``."""
        return {"residuals": {key: held.detach().to("cpu", copy=True) for key, held in self._stored.items()}}

    def load_state_dict(self, state_dict) -> None:
        """Replace every residual with those of ``state_dict`` (converted to the storage dtype; one that is
        not finite is zeroed with a warning). They move to the gradient's device at their first use."""
        residuals = state_dict.get("residuals") if isinstance(state_dict, dict) else None
        if not isinstance(residuals, dict):
            raise ValueError("expected a dict with a 'residuals' entry, as returned by state_dict()")
        loaded = {}
        for key, value in residuals.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
                raise ValueError(f"residual for {key!r} must be a 1-D float tensor, got {type(value).__name__}")
            value = value.detach().to(self.storage, copy=True)
            if not torch.isfinite(value).all():
                warnings.warn(f"residual for {key!r} in the loaded state is not finite; it is reset to zero")
                value.zero_()
            loaded[key] = value
        self.reset()
        self._stored = loaded
