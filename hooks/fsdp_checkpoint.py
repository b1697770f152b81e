"""gradcomp's FSDP state in the form ``torch.distributed.checkpoint`` (DCP) saves and loads.

DCP saves a tensor that is not a DTensor, and any plain value, once for all ranks (it takes them to
be replicated). Residuals are each rank's own, so they travel as DTensor rows: a piece's residual on
every rank is one ``[P, c]`` DTensor sharded by rows on the FSDP mesh, each rank writing and reading its
own row. The telemetry totals (``compress_s`` differs between ranks) travel the same way. What every
rank shares (format, step, world size, compressor, schedule) stays plain. The template :func:`dcp_state_dict`
gives DCP lists every residual the run can keep, zero where none is held, so that a checkpoint taken at
any step loads into a fresh process, whose residuals do not exist yet.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch.distributed.tensor import DTensor, Shard

from gradcomp.checkpoint import TELEMETRY_KEYS

__all__ = ["dcp_state_dict", "engine_state_dict"]

#: Telemetry totals that are counts (saved as float64 in the row, exact below 2**53).
_COUNTS = ("bytes_sent", "dense_bytes", "steps")


def _row(local: torch.Tensor, mesh) -> DTensor:
    """``local`` (``[n]``) as this rank's row of a ``[P, n]`` DTensor sharded by rows on ``mesh``."""
    return DTensor.from_local(local.reshape(1, -1).to(mesh.device_type), mesh, [Shard(0)], run_check=False)


def dcp_state_dict(saved: Mapping, residual_numels: Mapping[str, int], mesh, storage: torch.dtype) -> dict:
    """The engine's per-rank ``saved`` state (:func:`gradcomp.checkpoint.state_dict`) for DCP: without
    ``"rank"``, with a DTensor row per key of ``residual_numels`` (the held residual, else zeros of
    ``storage``) and the telemetry totals as a float64 row. Residuals held for other keys (loaded from
    a run of other settings, not yet used) are left out."""
    out = dict(saved)
    out.pop("rank", None)
    held = out.pop("residuals")
    out["residuals"] = {key: _row(held[key] if key in held else torch.zeros(numel, dtype=storage), mesh)
                        for key, numel in residual_numels.items()}
    totals = out.pop("telemetry")
    out["telemetry"] = _row(torch.tensor([float(totals[key]) for key in TELEMETRY_KEYS], dtype=torch.float64), mesh)
    return out


def _local(value) -> torch.Tensor:
    return value.to_local().reshape(-1) if isinstance(value, DTensor) else value


def engine_state_dict(state: Mapping, rank: int) -> dict:
    """The engine's per-rank format from :func:`dcp_state_dict`'s (as DCP loaded it; this rank's rows are
    its own, so ``"rank"`` is this rank's); the engine's own format (with ``"rank"``) passes unchanged.
    Shapes and values are checked by :func:`gradcomp.checkpoint.prepare_load`."""
    if not isinstance(state, Mapping) or "rank" in state:
        return state
    out = dict(state, rank=rank)
    residuals = state.get("residuals")
    if isinstance(residuals, Mapping):
        out["residuals"] = {key: _local(value) for key, value in residuals.items()}
    totals = _local(state.get("telemetry"))
    if isinstance(totals, torch.Tensor) and totals.numel() == len(TELEMETRY_KEYS):
        values = totals.tolist()
        out["telemetry"] = {key: int(value) if key in _COUNTS else float(value)
                            for key, value in zip(TELEMETRY_KEYS, values)}
    return out
