"""The drop-in optimizer's parameters: Horovod's naming and argument rules and messages (so that swapping
in the drop-in behaves the same), the units exchanged together, and their flattening."""
from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import horovod.torch as hvd
import torch
from horovod.common.util import split_list
from horovod.torch.mpi_ops import Average

__all__ = ["names_of", "check_horovod_arguments", "Unit", "build_units", "ddp_buckets", "flatten", "unflatten"]

#: DDP's bucket sizes (torch's defaults): the first bucket in gradient order closes at 1 MiB, the rest at 25 MiB.
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1024 * 1024, 25 * 1024 * 1024


def names_of(optimizer_groups, named_parameters) -> Dict[torch.nn.Parameter, str]:
    """Parameter -> name, with Horovod's rules and messages, so that a drop-in swap behaves the same."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [(f"allreduce.noname.{i}.{j}", v) for i, group in enumerate(optimizer_groups)
                            for j, v in enumerate(group["params"])]  # fmt: skip
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    seen, dups = set(), set()
    for name, _ in named_parameters:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: %s"
                         % ", ".join(sorted(dups)))
    unnamed = {id(v) for g in optimizer_groups for v in g["params"]} - {id(v) for _, v in named_parameters}
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         "Python object ids: %s" % ", ".join(str(i) for i in unnamed))
    return {v: k for k, v in named_parameters}


def op_name(op) -> str:
    """``hvd.Adasum`` for Horovod's reduction op ``2``: how a user wrote it, for error messages."""
    for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(hvd, name, object()) == op and isinstance(op, int) and not isinstance(op, bool):
            return f"hvd.{name}"
    return repr(op)


def check_horovod_arguments(num_groups, groups, backward_passes_per_step, op, gradient_predivide_factor):
    """Check ``hvd.DistributedOptimizer``'s own arguments as Horovod does; returns ``groups``."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen = set()
        for p in (p for group in groups for p in group):
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
    passes = backward_passes_per_step
    if isinstance(passes, bool) or not isinstance(passes, int) or passes <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    return groups


class Unit:
    """Parameters exchanged together: one parameter, or one group of ``groups``."""

    __slots__ = ("params", "names", "numels", "name")

    def __init__(self, params, names):
        self.params: Tuple[torch.nn.Parameter, ...] = tuple(params)
        self.names: Tuple[str, ...] = tuple(names)
        self.numels: Tuple[int, ...] = tuple(p.numel() for p in self.params)
        self.name = self.names[0] if len(self.names) == 1 else "+".join(self.names)


def flatten(grads: List[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    """``(flat, is_view)``: a view of a single contiguous gradient, else a concatenated copy."""
    if len(grads) == 1 and grads[0].is_contiguous():
        return grads[0].view(-1), True
    return torch.cat([g.reshape(-1) for g in grads]), False


def unflatten(flat: torch.Tensor, grads: List[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view(g.shape))
        offset += g.numel()


def ddp_buckets(params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """``params`` (in the model's order) cut as DDP cuts its buckets once it has seen a step: in reverse
    order, about the order backward produces their gradients, one run per dtype, a bucket closed once it
    holds :data:`FIRST_BUCKET_BYTES` (the first of its dtype) or :data:`BUCKET_BYTES`; the open ones last."""
    open_buckets: Dict[torch.dtype, List[torch.Tensor]] = {}
    held: Dict[torch.dtype, int] = {}  # bytes in each dtype's open bucket
    limits: Dict[torch.dtype, int] = {}
    closed = []
    for p in reversed(params):
        open_buckets.setdefault(p.dtype, []).append(p)
        held[p.dtype] = held.get(p.dtype, 0) + p.numel() * p.element_size()
        if held[p.dtype] >= limits.setdefault(p.dtype, FIRST_BUCKET_BYTES):
            closed.append(open_buckets.pop(p.dtype))
            held[p.dtype], limits[p.dtype] = 0, BUCKET_BYTES
    return closed + list(open_buckets.values())


def build_units(param_groups_of_optimizer, parameter_names, groups, process_set) -> List[Unit]:
    """The units exchanged together: one per parameter, or Horovod's ``groups`` (a count or lists)."""
    params = [p for group in param_groups_of_optimizer for p in group["params"] if p.requires_grad]
    name = parameter_names.get
    if groups is None:
        return [Unit([p], [name(p)]) for p in params]
    if isinstance(groups, list):
        ids = {id(p) for p in params}
        param_groups = [[p for p in group if id(p) in ids] for group in groups]
        grouped = {id(p) for group in param_groups for p in group}
        param_groups = [g for g in param_groups if g] + [[p] for p in params if id(p) not in grouped]
    else:  # Horovod's split: rank 0's parameter order, cut into `groups` pieces
        order = hvd.broadcast_object([name(p) for p in params], root_rank=0, name="gradcomp.parameter_order",
                                     process_set=process_set)  # fmt: skip
        params = sorted(params, key=lambda p: order.index(name(p)))
        param_groups = [g for g in split_list(params, groups) if g]
    for group in param_groups:
        if len({p.dtype for p in group}) > 1:
            listing = ", ".join(f"{name(p)}: {p.dtype}" for p in group)
            raise ValueError(f"a group is compressed as one flat tensor, so its parameters must share a dtype; "
                             f"got {listing}")
    return [Unit(group, [name(p) for p in group]) for group in param_groups]
