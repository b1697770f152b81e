"""An alpha-beta model of one step's gradient communication, per exchange.

Each message of ``b`` bytes over a link costs ``latency + b / bandwidth``. Collectives are the
bandwidth-optimal ones that Gloo, NCCL and MPI use at large sizes:

=================  =======================================  ======================================
collective         time                                      bytes a rank sends (= receives)
=================  =======================================  ======================================
ring allreduce     ``2 (P-1) (a + b / (P B))``               ``2 (P-1) b / P``
ring allgather     ``(P-1) (a + b / B)`` (``b`` per rank)    ``(P-1) b``
pairwise all2all   ``(P-1) (a + s / B)`` (``s`` per pair)    ``(P-1) s``
=================  =======================================  ======================================

Exchanges: each registered exchange models itself (its ``cost`` classmethod in
:mod:`gradcomp.exchanges`, payload sizes from the compressors' real ``layout()``, so bytes are
exact) with the collectives below; :func:`predict` takes an exchange's registered name.

Several nodes: a flat ring crosses each node boundary once per step, so it runs at the
inter-node link; an all-to-all's remote traffic of all ``L`` ranks of a node shares the node's
link; in the hierarchical exchange the ``L`` shard exchanges of a node run at once and share it
too (each gets ``B_inter / L``).

Compute: ``compress_s`` and ``decode_s`` seconds per element (measured by
``experiments/bench_kernels.py``, see :func:`Kernels.from_bench`), charged per element
compressed or decoded. Returned figures are per rank for one group of ``n`` elements.

``handed_bytes`` is what the engine hands to the collectives (the all-to-all input includes
the rank's own chunk); the telemetry's ``bytes_sent`` equals it, and tests check it exactly.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from gradcomp.compressors.base import Compressor
from gradcomp.exchanges import registry

__all__ = ["Link", "Cluster", "Kernels", "Cost", "predict", "predict_all", "gbit", "ring_allreduce",
           "ring_allgather", "all_to_all"]


def gbit(rate: float) -> float:
    """Bytes per second of a ``rate`` Gbit/s link."""
    return rate * 1e9 / 8


@dataclass(frozen=True)
class Link:
    """A link: ``latency_s`` per message, ``bandwidth`` bytes per second."""

    latency_s: float
    bandwidth: float

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be finite and >= 0, got {self.latency_s!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {self.bandwidth!r}")

    def time(self, messages: float, nbytes: float, share: float = 1.0) -> float:
        """``messages`` latencies plus ``nbytes`` at ``bandwidth / share``."""
        return messages * self.latency_s + nbytes * share / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """``world_size`` ranks, ``ranks_per_node`` to a node (``world_size`` for one node)."""

    world_size: int
    intra: Link
    inter: Optional[Link] = None
    ranks_per_node: Optional[int] = None

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        per_node = self.local_size
        if per_node < 1 or self.world_size % per_node:
            raise ValueError(f"world_size {self.world_size} is not a multiple of ranks_per_node {per_node}")
        if self.nodes > 1 and self.inter is None:
            raise ValueError("several nodes need an inter-node link")

    @property
    def local_size(self) -> int:
        return self.world_size if self.ranks_per_node is None else min(self.ranks_per_node, self.world_size)

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def bottleneck(self) -> Link:
        """The link a flat ring runs at."""
        return self.inter if self.nodes > 1 else self.intra


@dataclass(frozen=True)
class Kernels:
    """Seconds per element to compress and to decode(-add); zero leaves compute out."""

    compress_s: float = 0.0
    decode_s: float = 0.0

    @classmethod
    def from_bench(cls, path: str, op: str, backend: str = "numba", dtype: str = "float32",
                   density: Optional[float] = None, decode_s: Optional[float] = None) -> "Kernels":
        """From ``bench_kernels`` JSON: the median of ``{op}_compress`` (and ``{op}_decompress_add``
        when measured; else ``decode_s``, else the compress rate) divided by its ``n``."""
        with open(path) as handle:
            rows = json.load(handle)

        def rate(name: str) -> Optional[float]:
            found = [r["median_s"] / r["n"] for r in rows if r["op"] == name and r["backend"] == backend
                     and r["dtype"] == dtype and (density is None or r.get("density") == density)]
            return sorted(found)[len(found) // 2] if found else None

        compress = rate(f"{op}_compress")
        if compress is None:
            raise ValueError(f"{path} has no {op}_compress row for backend {backend}, {dtype}, density {density}")
        decode = rate(f"{op}_decompress_add")
        return cls(compress, decode if decode is not None else (decode_s if decode_s is not None else compress))


@dataclass
class Cost:
    """One exchange's prediction for one group, per rank."""

    exchange: str
    world_size: int
    numel: int
    handed_bytes: int  # handed to the collectives (what telemetry counts as bytes_sent)
    sent_bytes: float  # leaving the rank on the wire
    received_bytes: float
    comm_s: float
    compute_s: float
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.comm_s + self.compute_s

    def as_dict(self) -> dict:
        return {**asdict(self), "total_s": self.total_s}


def ring_allreduce(cluster: Cluster, nbytes: float) -> float:
    """Seconds of a ring allreduce of ``nbytes`` per rank."""
    p = cluster.world_size
    return 0.0 if p == 1 else cluster.bottleneck.time(2 * (p - 1), 2 * (p - 1) * nbytes / p)


def ring_allgather(cluster: Cluster, nbytes: float) -> float:
    """Seconds of a ring allgather of ``nbytes`` from each rank."""
    p = cluster.world_size
    return 0.0 if p == 1 else cluster.bottleneck.time(p - 1, (p - 1) * nbytes)


def all_to_all(cluster: Cluster, slot: float) -> float:
    """Seconds of a pairwise all-to-all of ``slot`` bytes per pair of ranks."""
    p, local = cluster.world_size, cluster.local_size
    if p == 1:
        return 0.0
    if cluster.nodes == 1:
        return cluster.intra.time(p - 1, (p - 1) * slot)
    # Remote traffic of the node's L ranks shares its link; local traffic runs alongside.
    remote = cluster.inter.time(p - local, local * (p - local) * slot)
    return max(remote, cluster.intra.time(local - 1, (local - 1) * slot))


def predict(exchange: str, compressor: Optional[Compressor], numel: int, cluster: Cluster,
            kernels: Kernels = Kernels(), dtype: torch.dtype = torch.float32) -> Cost:
    """The cost of the registered ``exchange`` for one group of ``numel`` elements of ``dtype`` on
    ``cluster``. Every exchange but the dense one needs ``compressor``; a combination the exchange
    cannot model (a group with fewer elements than ranks for two-phase) raises ``ValueError``."""
    return registry.get(exchange).cost(compressor, numel, cluster, kernels, dtype)


def predict_all(compressor: Compressor, numel: int, cluster: Cluster, kernels: Kernels = Kernels(),
                exchanges: Optional[Sequence[str]] = None) -> List[Cost]:
    """:func:`predict` for each of ``exchanges`` (default: every modelled exchange), leaving out those
    that cannot model ``compressor`` on ``numel`` elements and ``cluster`` (two-phase where ``numel < P``,
    an allreduce of payloads that cannot be summed)."""
    costs = []
    for name in exchanges if exchanges is not None else registry.names(modelled=True):
        try:
            costs.append(predict(name, compressor, numel, cluster, kernels))
        except ValueError:
            if exchanges is not None:
                raise
    return costs
