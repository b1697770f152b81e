"""The independent simulation of the ranks that ``test_fsdp.py`` holds gradcomp under FSDP2 to.

:func:`simulate` shares nothing with gradcomp's adapter, exchange or residual memory: it trains one
unsharded replica of ``fsdp_workers``' model on every rank's batch, lays each FSDP module's gradients
out as FSDP's reduce-scatter input (rows of dim-0 chunks, zero-padded), keeps every rank's residual,
compresses each parameter's piece of each row with the compressor's own ``compress``/``decompress``
(torch backend), and averages each row in rank order.
"""
import math

import torch
from torch import nn

from fsdp_workers import MIN_NUMEL, UNITS, loss_of, model, optimizer_of, tokens
from gradcomp import from_spec


def unit_params(net: nn.Module) -> dict:
    """``{unit: [(name, parameter)]}``: each FSDP module's parameters in FSDP's order (the module's own,
    in ``named_parameters`` order, without those of nested FSDP modules; a tied parameter once)."""
    owner, seen = {}, set()
    for unit in UNITS:
        for name, param in net.get_submodule(unit).named_parameters(prefix=unit):
            if id(param) not in seen and not any(name.startswith(u + ".") for u in UNITS[:UNITS.index(unit)] if u):
                seen.add(id(param))
                owner.setdefault(unit, []).append((name, param))
    return owner


def _rows(params, grads: dict, world_size: int) -> torch.Tensor:
    """FSDP's reduce-scatter input: row j holds the j-th chunk of each parameter's zero-padded dim 0."""
    rows = []
    for j in range(world_size):
        for name, param in params:
            chunk = math.ceil(param.shape[0] / world_size)
            padded = torch.zeros((chunk * world_size,) + tuple(param.shape[1:]))
            padded[: param.shape[0]] = grads[name]
            rows.append(padded[j * chunk:(j + 1) * chunk].reshape(-1))
    return torch.cat(rows)


def _unrows(params, flat: torch.Tensor, world_size: int) -> dict:
    """The inverse of :func:`_rows`: each parameter's whole gradient from its pieces."""
    pieces, offset = {name: [] for name, _ in params}, 0
    for _ in range(world_size):
        for name, param in params:
            chunk = math.ceil(param.shape[0] / world_size)
            numel = chunk * math.prod(param.shape[1:])
            pieces[name].append(flat[offset: offset + numel].reshape((chunk,) + tuple(param.shape[1:])))
            offset += numel
    return {name: torch.cat(pieces[name])[: param.shape[0]] for name, param in params}


def _decoded(compressor, acc: torch.Tensor, numels, dense_below: int) -> torch.Tensor:
    """``D(C(acc))`` of one row, piece by piece (a piece under ``dense_below`` sent as it is)."""
    out, offset = torch.zeros_like(acc), 0
    for numel in numels:
        piece = acc[offset: offset + numel]
        if numel < dense_below or compressor is None:
            out[offset: offset + numel] = piece
        else:
            compressor.decompress(compressor.compress(piece, backend="torch"), out[offset: offset + numel], "torch")
        offset += numel
    return out


def _piece_numels(params, world_size: int):
    return [math.ceil(p.shape[0] / world_size) * math.prod(p.shape[1:]) for _, p in params]


def _dense_below(units: dict, world_size: int, case: dict) -> int:
    """Pieces under this many elements travel dense: ``min_numel / P``, raised by ``residual_share`` to the
    smallest piece among the largest ones that together hold that share of the elements."""
    smallest = case.get("min_numel", MIN_NUMEL)
    share = case.get("residual_share", 1.0)
    if share < 1.0:
        sizes = sorted((n for params in units.values() for n in _piece_numels(params, world_size)), reverse=True)
        covered = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        smallest = max(smallest, world_size * next(n for n, c in zip(sizes, covered) if c >= share * sum(sizes)))
    return math.ceil(smallest / world_size)


def _kept(residual: torch.Tensor, numels, dense_below: int, dtype: torch.dtype) -> torch.Tensor:
    """A committed residual as the rank keeps it: rounded to ``dtype``, nothing for dense pieces."""
    kept, offset = residual.to(dtype).float(), 0
    for numel in numels:
        if numel < dense_below:
            kept[offset: offset + numel] = 0.0
        offset += numel
    return kept


def _average(compressor, acc, numels, dense_below: int, world_size: int):
    """``(the rank-ordered average of the decoded rows, what each rank kept back)``."""
    sent = [_decoded(compressor, a, numels, dense_below) for a in acc]
    total = torch.zeros_like(acc[0])
    for r in range(world_size):  # rank order
        total += sent[r]
    return total / world_size, [a - s for a, s in zip(acc, sent)]


def local_gradients(world_size: int, step: int = 0) -> list:
    """Each rank's own gradient of ``step``'s batch at the initial parameters (``[{name: grad}]``)."""
    net, out = model(), []
    for rank in range(world_size):
        net.zero_grad()
        loss_of(net, tokens(rank, step)).backward()
        out.append({name: p.grad.clone() for name, p in net.named_parameters()})
    return out


def simulate(world_size: int, case: dict, specs=None) -> dict:
    """What :func:`train` must produce for ``case``: every step's averaged gradients, the norms a clip
    measures and the final parameters. ``specs``: the compressor of each step (``None``: dense), else
    ``case["spec"]`` but at ``case["dense_at"]``."""
    net, base = model(), from_spec(case["spec"])
    optimizer, scheduler = optimizer_of(net, case)
    units, residuals = unit_params(net), {}
    whole = case.get("granularity") == "bucket"  # a row compressed as one tensor, every piece keeps a residual
    dense_below = 0 if whole else _dense_below(units, world_size, case)
    storage = getattr(torch, case.get("residual_dtype", "float32"))
    out = {"grads": [], "norms": []}
    for step in range(case["steps"]):
        local = []
        for rank in range(world_size):
            net.zero_grad()
            loss_of(net, tokens(rank, step)).backward()
            local.append({name: p.grad.clone() for name, p in net.named_parameters()})
        compressor = (None if step in case.get("dense_at", ()) else base) if specs is None else (
            specs[step] and from_spec(specs[step]))
        averaged = {}
        for unit, params in units.items():
            numels = _piece_numels(params, world_size)
            numels = [sum(numels)] * world_size if whole else numels * world_size
            acc = [_rows(params, local[r], world_size) + residuals.get((unit, r), 0.0) for r in range(world_size)]
            average, kept = _average(compressor, acc, numels, dense_below, world_size)
            for r in range(world_size):
                residuals[(unit, r)] = _kept(kept[r], numels, dense_below, storage)
            averaged.update(_unrows(params, average, world_size))
        for name, param in net.named_parameters():
            param.grad = averaged[name].clone()
        out["grads"].append(averaged)
        if case.get("clip"):
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), case["clip"])))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    out["params"] = {name: p.detach().clone() for name, p in net.named_parameters()}
    return out
