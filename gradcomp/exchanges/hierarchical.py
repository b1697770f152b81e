"""The hierarchical exchange, as modelled: dense inside a node, two-phase compressed between nodes.

Not yet run by the engine (``runnable = False``; ``Engine(exchange=...)`` does not offer it): its
cost model lets the scaling study compare it. With ``L`` ranks per node and ``N = P / L`` nodes,
each group is reduce-scattered dense inside the node (intra-node link), each rank exchanges its
``n / L`` shard with the ranks of the same position on the other nodes by the two-phase exchange
(the ``L`` shard exchanges of a node share its link, each at ``B_inter / L``), and the node
allgathers the shards dense. Running it is one more method set here (``applies``, ``compress``,
``start``, ``finish``) and a transport with sub-groups.
"""
from __future__ import annotations

import math

import torch

from gradcomp import costmodel
from gradcomp.exchanges.base import Exchange
from gradcomp.exchanges.registry import exchange_name
from gradcomp.exchanges.two_phase import slot_nbytes

__all__ = ["Hierarchical"]


@exchange_name("hierarchical")
class Hierarchical(Exchange):
    """Modelled only; see the module docstring."""

    label = "hierarchical"
    runnable = False
    node_aware = True

    def applies(self, compressor, numel, dtype, device, transport) -> bool:
        return False

    def start(self, context, handle) -> None:
        raise NotImplementedError("the hierarchical exchange is modelled only")

    def finish(self, context, handle, result):
        raise NotImplementedError("the hierarchical exchange is modelled only")

    @classmethod
    def cost(cls, compressor, numel, cluster, kernels, dtype=torch.float32):
        """Dense halves of a ring allreduce inside the node plus a two-phase exchange of the float32
        shard between nodes; compute for the shard's two stages."""
        if compressor is None:
            raise ValueError(f"exchange {cls.name!r} needs a compressor")
        p, local, nodes = cluster.world_size, cluster.local_size, cluster.nodes
        element = torch.empty((), dtype=dtype).element_size()
        nbytes = numel * element
        intra = costmodel.ring_allreduce(costmodel.Cluster(local, cluster.intra), nbytes)
        wire_intra = 2 * (local - 1) * nbytes / local
        if nodes == 1:
            return costmodel.Cost(cls.name, p, numel, nbytes, wire_intra, wire_intra, intra, 0.0,
                                  {"intra_s": intra, "inter_s": 0.0})
        shard = math.ceil(numel / local)
        slot1, slot2 = slot_nbytes(compressor, shard, nodes, torch.float32)
        shared = costmodel.Link(cluster.inter.latency_s, cluster.inter.bandwidth / local)
        across = costmodel.Cluster(nodes, shared)
        inter = costmodel.all_to_all(across, slot1) + costmodel.ring_allgather(across, slot2)
        chunk = math.ceil(shard / nodes)
        compute = kernels.compress_s * (shard + chunk) + kernels.decode_s * (nodes * chunk + shard)
        wire_inter = (nodes - 1) * (slot1 + slot2)
        return costmodel.Cost(cls.name, p, numel, nbytes + nodes * slot1 + slot2 + shard * element,
                              wire_intra + wire_inter, wire_intra + wire_inter, intra + inter, compute,
                              {"intra_s": intra, "inter_s": inter, "slot1": slot1, "slot2": slot2,
                               "inter_bytes": wire_inter})
