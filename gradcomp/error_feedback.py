"""Error feedback: the residual each rank keeps so that nothing it drops is lost.

Each step, for a group of tensors compressed together (a DDP bucket, a Horovod
parameter)::

    acc = g + e            # compensate
    payload = C(acc)       # compress
    e' = acc - D(payload)  # update memory (fused into the compress kernel)

Residuals are kept *per key* (a parameter name), not per flat bucket, so a bucket
whose layout changes -- DDP rebuilds its buckets after the first iteration, and a
resumed process may bucket differently -- still finds each parameter's residual.
For speed, the residuals of one group live in one flat float32 buffer laid out like
the group, so the fused kernels read and write them in a single pass.

Updates are transactional: the kernel writes ``e'`` into a spare buffer and the caller
commits it only once the exchanged result is known to be finite. A step that produced
NaN/Inf on any rank leaves every rank's residual exactly as it was.
"""
from __future__ import annotations

import logging
import warnings
from typing import Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch

logger = logging.getLogger(__name__)

class _Group:
    """Flat residuals of several keys: ``current`` is committed, ``spare`` is scratch."""

    __slots__ = ("keys", "offsets", "numels", "current", "spare", "pending")

    def __init__(self, keys, numels, device):
        self.keys: Tuple[Hashable, ...] = tuple(keys)
        self.numels: Tuple[int, ...] = tuple(int(n) for n in numels)
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        self.offsets: Tuple[int, ...] = tuple(offsets)
        self.current = torch.zeros(total, dtype=torch.float32, device=device)
        self.spare: Optional[torch.Tensor] = None
        # A commit whose acceptance is still a device tensor: resolved at next access,
        # so that deciding it never blocks inside a communication callback.
        self.pending: Optional[Union[bool, torch.Tensor]] = None

    def slice(self, position: int) -> torch.Tensor:
        start = self.offsets[position]
        return self.current[start : start + self.numels[position]]

    def resolve(self) -> None:
        if self.pending is None:
            return
        accept = bool(self.pending)
        self.pending = None
        if accept:
            self.current, self.spare = self.spare, self.current


class ErrorFeedback:
    """Residual memory keyed by caller-given keys. Residuals are float32 whatever the
    gradient dtype.

    Example::

        >>> ef = ErrorFeedback()
        >>> residual_in, residual_out = ef.buffers(["fc.weight"], [grad.numel()], grad.device)
        >>> payload = compressor.compress(grad, residual_in, residual_out)   # writes e' into residual_out
        >>> ef.commit(["fc.weight"])                                # e <- e'
    """

    def __init__(self):
        self._groups: Dict[Tuple[Hashable, ...], _Group] = {}
        self._owner: Dict[Hashable, Tuple[Hashable, ...]] = {}
        # Residuals loaded from a state dict, waiting for their key's first use.
        self._loaded: Dict[Hashable, torch.Tensor] = {}
        self._regroup_logged = False

    def buffers(self, keys: Sequence[Hashable], numels: Sequence[int], device) -> Tuple[torch.Tensor, torch.Tensor]:
        """Flat ``(residual_in, residual_out)`` float32 buffers for ``keys`` laid out in that order,
        in the order the kernels take them (``compress(grad, residual_in, residual_out)``).

        ``residual_in`` holds the committed residuals ``e`` (zeros for a new key); ``residual_out``
        is a same-sized spare buffer for the kernel to write ``e'`` into, made the committed one by
        :meth:`commit`. Neither is mutated here beyond moving residuals of ``keys`` out of groups
        laid out differently (a DDP bucket rebuild), which is logged once.
        """
        group_key = tuple(keys)
        group = self._groups.get(group_key)
        same_layout = group is not None and group.numels == tuple(int(n) for n in numels)
        if not same_layout or group.current.device != torch.device(device):
            group = self._regroup(group_key, numels, device)
        group.resolve()
        if group.spare is None:
            group.spare = torch.empty_like(group.current)
        return group.current, group.spare

    def commit(self, keys: Sequence[Hashable], accept: Union[bool, torch.Tensor] = True, decay: float = 1.0) -> None:
        """Make the spare buffer of ``keys``, times ``decay``, the committed residual if ``accept``.

        ``accept`` may be a 0-d bool tensor still being computed on a device; it is read
        at the next access of these keys, not now. The spare is scaled whatever the decision
        (it is scratch when the step is rejected), so no decision is waited for here.
        """
        group = self._groups[tuple(keys)]
        group.resolve()
        if decay != 1.0:
            group.spare.mul_(decay)
        group.pending = accept

    def _regroup(self, group_key, numels, device) -> _Group:
        if len(set(group_key)) != len(group_key):
            raise ValueError(f"duplicate keys in {group_key!r}")
        group = _Group(group_key, numels, device)
        emptied: List[Tuple[Hashable, ...]] = []
        moved = any(self._owner.get(key) not in (None, group_key) for key in group_key)
        for position, key in enumerate(group_key):
            source = self._take(key, emptied)
            if source is None:
                continue
            if source.numel() != group.numels[position]:
                raise ValueError(
                    f"residual for {key!r} has {source.numel()} elements but the gradient has "
                    f"{group.numels[position]}; was the model changed after the residual was saved?"
                )
            group.slice(position).copy_(source)
        if moved and not self._regroup_logged:
            self._regroup_logged = True
            logger.info("gradcomp: residuals regrouped into a new layout of %d parameters (first: %r), "
                        "e.g. after a DDP bucket rebuild", len(group_key), group_key[0])
        for old_key in emptied:
            del self._groups[old_key]
        self._groups[group_key] = group
        for key in group_key:
            self._owner[key] = group_key
        return group

    def _take(self, key, emptied) -> Optional[torch.Tensor]:
        """Remove ``key``'s residual from wherever it is and return it (or ``None``)."""
        if key in self._loaded:
            return self._loaded.pop(key)
        old_key = self._owner.pop(key, None)
        if old_key is None:
            return None
        old = self._groups[old_key]
        old.resolve()
        if all(self._owner.get(k) != old_key for k in old.keys):
            emptied.append(old_key)
        return old.slice(old.keys.index(key))

    def residual(self, key: Hashable) -> Optional[torch.Tensor]:
        """The committed residual of ``key`` (a view; ``None`` if it has none yet)."""
        if key in self._loaded:
            return self._loaded[key]
        group_key = self._owner.get(key)
        if group_key is None:
            return None
        group = self._groups[group_key]
        group.resolve()
        return group.slice(group.keys.index(key))

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Forget the residuals of ``keys`` (those it has); the others are kept."""
        emptied: List[Tuple[Hashable, ...]] = []
        for key in keys:
            self._take(key, emptied)
        for old_key in emptied:
            del self._groups[old_key]

    def flush_into(self, keys: Sequence[Hashable], numels: Sequence[int], grad: torch.Tensor) -> List[Hashable]:
        """Add the residuals held for ``keys`` (laid out by ``numels``) into the flat ``grad``
        (mutated) and forget them, so a group that goes dense after being compressed loses nothing
        it held back. Returns the keys that held a residual.

        Forgotten rather than zeroed: a group that stays dense (a policy's dense verdict) then costs
        no pass over zeros at every step, and holds no residual memory; a later compressed step
        starts from zeros, as a new key does."""
        if not self._owner and not self._loaded:
            return []
        offset, flushed = 0, []
        for key, n in zip(keys, numels):
            residual = self.residual(key)
            if residual is not None:
                if residual.numel() != n:
                    raise RuntimeError(f"the residual of {key!r} has {residual.numel()} elements, its gradient {n}")
                grad[offset: offset + n].add_(residual.to(grad.dtype))
                flushed.append(key)
            offset += n
        self.drop(flushed)
        return flushed

    def keys(self) -> List[Hashable]:
        return list(self._owner) + list(self._loaded)

    def reset(self) -> None:
        """Forget every residual."""
        self._groups.clear()
        self._owner.clear()
        self._loaded.clear()

    def state_dict(self) -> Dict[str, Dict[Hashable, torch.Tensor]]:
        """``{"residuals": {key: float32 tensor}}``, one entry per key, layout-free, on CPU."""
        return {"residuals": {key: self.residual(key).detach().to("cpu", copy=True) for key in self.keys()}}

    def load_state_dict(self, state_dict) -> None:
        """Replace every residual with those of ``state_dict`` (see :meth:`state_dict`).

        Residuals are placed when their key is next used, on that gradient's device.
        """
        residuals = state_dict.get("residuals") if isinstance(state_dict, dict) else None
        if not isinstance(residuals, dict):
            raise ValueError("expected a dict with a 'residuals' entry, as returned by ErrorFeedback.state_dict()")
        loaded = {}
        for key, value in residuals.items():
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
                raise ValueError(f"residual for {key!r} must be a 1-D float tensor, got {type(value).__name__}")
            value = value.detach().to(torch.float32, copy=True)
            if not torch.isfinite(value).all():
                warnings.warn(f"residual for {key!r} in the loaded state is not finite; it is reset to zero")
                value.zero_()
            loaded[key] = value
        self.reset()
        self._loaded = loaded
