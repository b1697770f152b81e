"""Each coordinate's late gradient applied as the optimizer's momentum would have applied it on time.

Top-k with error feedback holds a coordinate back until its accumulated value is among the largest, then
releases it: ``a`` steps of its gradient reach the optimizer at once, late. A momentum run after the exchange
would then spread that burst over its own memory (about ten steps at 0.9), on top of the wait: a delayed
gradient acts as momentum of its own (Mitliagkas et al., 2016). The catch-up takes the burst ``r`` of a
coordinate that waited ``a`` steps as ``a`` equal gradients ``r / a`` of ages ``1..a`` and applies it as the
momentum would have applied them by now: its buffer takes the share ``c`` of the burst that would still be in it,
the parameter moves at once by what would already have been applied,

    ``c = S1(a) / a``, ``S1(a) = (1 - beta^a) / (1 - beta)``; the buffer takes ``c r``, the parameter
    ``(1 - c) / (1 - beta)`` of the burst at the momentum's rate (times ``1 - dampening`` under SGD; Adam's
    exponential average, whose dampening is ``beta``, moves it by ``(1 - c) r`` at its step size).

``a = 1`` gives ``c = 1``: the optimizer's own step. ``a`` is the number of steps since the coordinate was last
nonzero in the average, which every rank reads alike from the average it holds (no message). The stages
(:class:`~gradcomp.optim.DelayedMomentumSGD`, :class:`~gradcomp.optim.FrozenVarianceAdam`) keep the counts in a
:class:`Waits`, per parameter of a group a sparsifier compressed this step; a dense step, or a quantizer's (every
coordinate every step), drops them.
"""
from __future__ import annotations

import functools
from typing import Dict, Hashable, Iterable, List

import torch

from gradcomp.optim.delay import held_back_density

__all__ = ["Waits", "share_table", "MAX_WAIT", "SATURATE_EVERY"]

#: The longest wait a coordinate's count holds (int16); past it a burst is taken as this many steps old, which
#: changes ``c`` by less than ``beta ** MAX_WAIT`` relative to the true count's.
MAX_WAIT = 32767
#: Steps between two clamps of the waits (:meth:`Waits.begin_step`).
SATURATE_EVERY = 1024


@functools.lru_cache(maxsize=16)
def share_table(beta: float, device: torch.device) -> torch.Tensor:
    """``c`` of every wait ``a`` in ``0..MAX_WAIT`` (float32 ``[MAX_WAIT + 1]``, read-only): the share of a burst
    that the momentum would have left in its buffer, per element of the burst, ``(1 - beta^a) / ((1 - beta) a)``
    (``a = 0`` reads 0), ``beta`` and ``1 - beta`` in float32 so that ``a = 1`` gives ``c = 1`` exactly. Once per
    momentum: a power per element and step was most of the SGD stage's step (281,568 elements, one thread,
    informal), and the values are the power's, bit for bit."""
    base = torch.tensor(beta, dtype=torch.float32)
    ages = torch.arange(MAX_WAIT + 1, dtype=torch.float32)
    shares = torch.pow(base, ages).neg_().add_(1.0).div_(float(1.0 - base)).div_(ages)
    shares[0] = 0.0
    return shares.to(device)


class Waits:
    """The steps each coordinate of a compressed parameter has waited, by the engine's key.

    :attr:`waits` maps a key to an int16 tensor of its parameter's shape, kept while the parameter's group is
    compressed by a sparsifier (the same on every rank); :attr:`compressed` holds the keys the engine compressed
    so in the step under way (:meth:`record`, :meth:`drop`), which :meth:`begin_step` consumes.
    """

    def __init__(self):
        self.waits: Dict[Hashable, torch.Tensor] = {}
        self.compressed: set = set()
        self._since_clamp = SATURATE_EVERY  # clamp at the first step (a loaded checkpoint's waits too)

    # -- what the engine did with each group this step --------------------------------------------
    def record(self, keys: Iterable[Hashable], compressor) -> None:
        """``keys`` were compressed by ``compressor``: they wait where it holds coordinates back (a quantizer
        sends every coordinate every step: nothing waits)."""
        if held_back_density(compressor) < 1:
            self.compressed.update(keys)
        else:
            self.compressed.difference_update(keys)

    def drop(self, keys: Iterable[Hashable]) -> None:
        """``keys`` went dense this step: everything was sent."""
        self.compressed.difference_update(keys)

    def begin_step(self) -> set:
        """The keys compressed by a sparsifier in this step (then forgotten); every other key's wait is dropped.
        Clamps the waits below :data:`MAX_WAIT` once every :data:`SATURATE_EVERY` steps (a wait grows by at most
        one a step; one int16 clamp per tensor)."""
        compressed, self.compressed = self.compressed, set()
        for key in [key for key in self.waits if key not in compressed]:
            del self.waits[key]
        self._since_clamp += 1
        if self._since_clamp >= SATURATE_EVERY:
            if self.waits:  # waits made after this start at 0
                torch._foreach_clamp_max_(list(self.waits.values()), MAX_WAIT - SATURATE_EVERY)
            self._since_clamp = 0
        return compressed

    # -- one step of a param group --------------------------------------------------------------------
    def shares(self, keys: List[Hashable], params: List[torch.Tensor], beta: float) -> List[torch.Tensor]:
        """Advance the waits of ``keys`` by this step (allocated at 0 on a parameter's first compressed step) and
        return each parameter's ``c`` (float32, its shape; new tensors)."""
        table = share_table(float(beta), params[0].device)
        waits = self.waits_of(keys, params)
        torch._foreach_add_(waits, 1)  # this step's gradient is 1 step old
        return [table.index_select(0, wait.view(-1).int()).view(wait.shape) for wait in waits]

    def waits_of(self, keys: List[Hashable], params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The waits of ``keys`` (int16, each parameter's shape; allocated at 0 on a parameter's first compressed
        step), not advanced: the caller's step advances and settles them (Adam's ``caught_up_update``)."""
        for key, param in zip(keys, params):
            if key not in self.waits:  # allocated once, not at every step
                self.waits[key] = torch.zeros(param.shape, dtype=torch.int16, device=param.device)
        return [self.waits[key] for key in keys]

    def settle(self, keys: List[Hashable], averages: List[torch.Tensor]) -> None:
        """A coordinate nonzero in its average (``averages``, one per key, read only) waits no more."""
        for key, average in zip(keys, averages):
            self.waits[key].mul_(average == 0)

    def clear(self) -> None:
        """Forget every wait (the residuals were reset or flushed: nothing is held back)."""
        self.waits.clear()
        self.compressed.clear()

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[Hashable, torch.Tensor]:
        """``{key: int16 tensor}`` on CPU, the same on every rank."""
        return {key: wait.to("cpu", copy=True) for key, wait in self.waits.items()}

    def prepare_load(self, waits, names: Dict[Hashable, torch.nn.Parameter], owner: str):
        """Check ``waits`` (:meth:`state_dict`'s output) against the parameters ``names`` (raises ``ValueError``
        naming ``owner``, changing nothing); returns the function that assigns it."""
        if not isinstance(waits, dict):
            raise ValueError(f"the checkpoint's {owner} waits are not a dict of int16 tensors by parameter name")
        for key, wait in waits.items():
            param = names.get(key)
            if param is None:
                raise ValueError(f"the checkpoint's {owner} state has a wait for {key!r}, which is no parameter here")
            if (not isinstance(wait, torch.Tensor) or wait.dtype != torch.int16 or wait.shape != param.shape
                    or bool((wait < 0).any())):
                raise ValueError(f"the checkpoint's wait for {key!r} is not an int16 tensor >= 0 of shape "
                                 f"{tuple(param.shape)}")

        def assign() -> None:
            self.waits = {key: wait.to(names[key].device, copy=True) for key, wait in waits.items()}
            self.compressed = set()
            self._since_clamp = SATURATE_EVERY

        return assign
