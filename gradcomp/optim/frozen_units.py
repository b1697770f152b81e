"""What Adam's frozen-variance stage sends in its update units: this rank's next first moment (``exchange=
"momentum"``), and the group's divisor (``exchange="gradient"``) that the kernels apply as they load and finish.

Both read the stage (:class:`~gradcomp.optim.frozen_adam.FrozenVarianceAdam`) and its optimizer; neither keeps a
copy of the optimizer's settings.
"""
from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Tuple

import torch

from gradcomp.optim.adam_settings import decoupled_weight_decay
from gradcomp.optim.delay import compressed_momentum, delay_at, held_back_density, memory_share

__all__ = ["next_moments", "group_divisor"]


def next_moments(stage, pieces, compressor) -> List[Tuple[Hashable, torch.Tensor, torch.Tensor]]:
    """This rank's next first moment of each piece (``(key, parameter, group, slice)``, the slice holding the
    gradient), written into the slices (mutated); returns ``(key, next moment, moment)`` for the stage's commit."""
    delay = delay_at(held_back_density(compressor), stage.delay_steps)
    by_weight: Dict[float, list] = {}  # param groups with another beta1 lerp apart
    for key, param, group, piece in pieces:
        if group["weight_decay"] and not decoupled_weight_decay(stage.optimizer, group):
            piece.add_(param.detach().reshape(-1).float(), alpha=group["weight_decay"])
        moment = stage.moments.get(key)
        if moment is None:  # the first compressed step starts from Adam's own first moment
            moment = stage.optimizer.state[param]["exp_avg"].reshape(-1).float().clone()
        weight = 1 - compressed_momentum(group["betas"][0], delay * memory_share(group["betas"][0]))
        by_weight.setdefault(weight, []).append((key, piece, moment))
    pending = []
    for weight, entries in by_weight.items():
        keys, slices, moments = zip(*entries)
        following = torch._foreach_lerp(moments, slices, weight)
        torch._foreach_copy_(slices, following)
        pending += zip(keys, following, moments)
    return pending


def group_divisor(stage, keys, numels) -> Optional[torch.Tensor]:
    """The group of ``keys`` (``numels`` elements each) as the stage divides it before the compress and multiplies
    its average after: float32 ``[n]``, each frozen parameter's denominator (computed here at the freeze, as the
    compress would) and 1.0 elsewhere (``x / 1.0`` and ``x * 1.0`` are ``x``, so the kernels that apply it are
    bitwise the stage's own passes); ``None`` if no parameter is frozen.

    Kept in ``stage.divisors`` with the denominators it copies, which it holds so that their ids stay unique, and
    built again when one of them is another tensor (the freeze, a resume, an optimizer's ``load_state_dict``)."""
    groups = stage._groups()
    denoms = []
    for key in keys:
        param = stage._param(key)
        denoms.append(stage._denom(param, groups[id(param)]) if stage.frozen(param) else None)
    if all(denom is None for denom in denoms):
        return None
    held = stage.divisors.get(tuple(keys))
    if held is not None and len(held[0]) == len(denoms) and all(a is b for a, b in zip(held[0], denoms)):
        return held[1]
    flat = torch.cat([torch.ones(n, dtype=torch.float32, device=stage._param(key).device) if denom is None
                      else denom.reshape(-1).float() for key, n, denom in zip(keys, numels, denoms)])
    stage.divisors[tuple(keys)] = (tuple(denoms), flat)
    return flat
