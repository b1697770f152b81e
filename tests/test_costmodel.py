"""The alpha-beta cost model: exact bytes from the compressors' layouts, and the known asymptotics."""
import math

import pytest
import torch

from gradcomp import TopK, TwoBit
from gradcomp.costmodel import Cluster, Kernels, Link, gbit, predict
from gradcomp.exchanges.two_phase import VERDICT_NBYTES, chunk_bounds, chunk_layouts

LAN = Link(latency_s=50e-6, bandwidth=gbit(10))


def one_node(p):
    return Cluster(p, LAN)


@pytest.mark.parametrize("p", [2, 3, 4, 7])
@pytest.mark.parametrize("numel", [1000, 1001, 4099])
def test_two_phase_bytes_are_the_chunk_layouts(p, numel):
    compressor = TwoBit(0.5)
    bounds = chunk_bounds(numel, p)
    sizes = [bounds[j + 1] - bounds[j] for j in range(p)]
    assert sum(sizes) == numel and max(sizes) - min(sizes) <= 1
    # 2-bit: ceil(c / 16) int32 words, rounded up to 8 bytes, for the largest chunk.
    slot = math.ceil(math.ceil(max(sizes) / 16) * 4 / 8) * 8
    cost = predict("two_phase", compressor, numel, one_node(p))
    # Phase 2's slot starts with the owner's verdict on the phase-1 chunks it received.
    assert cost.parts["slot1"] == cost.parts["slot2"] - VERDICT_NBYTES == slot
    assert cost.handed_bytes == p * slot + slot + VERDICT_NBYTES
    assert cost.sent_bytes == (p - 1) * (2 * slot + VERDICT_NBYTES)


def test_topk_bytes_per_chunk_and_dtype():
    compressor, numel, p = TopK(0.01), 100_003, 4
    layouts16, slot16 = chunk_layouts(compressor, numel, p, torch.float16)
    layouts32, slot32 = chunk_layouts(compressor, numel, p, torch.float32)
    k = math.ceil(0.01 * 25_001)  # the largest chunk
    assert slot16 == math.ceil(2 * k / 8) * 8 + math.ceil(4 * k / 8) * 8
    assert slot32 == 2 * math.ceil(4 * k / 8) * 8
    cost = predict("two_phase", compressor, numel, one_node(p), dtype=torch.float16)
    assert cost.handed_bytes == p * slot16 + slot32 + VERDICT_NBYTES


def test_allgather_and_dense_bytes():
    numel, p = 1 << 20, 8
    compressor = TopK(0.01)
    k = math.ceil(0.01 * numel)
    gather = predict("allgather", compressor, numel, one_node(p))
    assert gather.handed_bytes == compressor.layout(numel, torch.float32).nbytes == 8 * k
    assert gather.received_bytes == (p - 1) * 8 * k
    dense = predict("dense", None, numel, one_node(p))
    assert dense.handed_bytes == 4 * numel
    assert dense.sent_bytes == pytest.approx(2 * (p - 1) / p * 4 * numel)


def test_asymptotics():
    numel = 10_000_000
    compressor = TwoBit(0.5)
    payload = compressor.layout(numel, torch.float32).nbytes
    received = {p: predict("allgather", compressor, numel, one_node(p)).received_bytes for p in (2, 16, 256)}
    assert received[256] > 100 * received[2]  # allgather grows linearly in P
    for p in (2, 16, 256, 1024):
        dense = predict("dense", None, numel, one_node(p))
        assert 4 * numel <= dense.sent_bytes < 8 * numel + 1  # ring: 2 (P-1)/P x 4n
        two = predict("two_phase", compressor, numel, one_node(p))
        assert 2 * payload * (p - 1) / p <= two.sent_bytes <= 2 * payload * 1.05  # ~ 2 x compressed size
    # At 1 Gbit/s and P = 256, 2-bit allgather is slower than dense; two-phase is not.
    slow = Cluster(256, Link(50e-6, gbit(1)))
    dense_s = predict("dense", None, numel, slow).comm_s
    assert predict("allgather", compressor, numel, slow).comm_s > dense_s
    assert predict("two_phase", compressor, numel, slow).comm_s < dense_s / 4


def test_alpha_beta_time_and_kernels():
    link = Link(latency_s=1e-3, bandwidth=1e6)
    cost = predict("dense", None, 1000, Cluster(4, link))
    assert cost.comm_s == pytest.approx(6 * 1e-3 + 6 * 1000 / 1e6)  # 2(P-1) steps of 4n/P bytes
    kernels = Kernels(compress_s=1e-9, decode_s=2e-9)
    gather = predict("allgather", TwoBit(0.5), 1600, Cluster(4, link), kernels)
    assert gather.compute_s == pytest.approx(1600 * 1e-9 + 4 * 1600 * 2e-9)


def test_hierarchical_uses_the_node_link_inside():
    fast, slow = Link(5e-6, gbit(200)), Link(50e-6, gbit(10))
    cluster = Cluster(64, fast, slow, ranks_per_node=8)
    hier = predict("hierarchical", TwoBit(0.5), 10_000_000, cluster)
    flat = predict("two_phase", TwoBit(0.5), 10_000_000, cluster)
    dense = predict("dense", None, 10_000_000, cluster)
    assert hier.comm_s < dense.comm_s
    assert hier.parts["inter_bytes"] < flat.sent_bytes  # only a 1/8 shard crosses nodes per rank


def test_bad_input():
    with pytest.raises(ValueError, match="bandwidth"):
        Link(1e-6, 0)
    with pytest.raises(ValueError, match="multiple"):
        Cluster(10, LAN, LAN, ranks_per_node=4)
    with pytest.raises(ValueError, match="unknown exchange"):
        predict("ring", TwoBit(0.5), 100, one_node(2))
    with pytest.raises(ValueError, match="numel >= world_size"):
        predict("two_phase", TwoBit(0.5), 3, one_node(4))
