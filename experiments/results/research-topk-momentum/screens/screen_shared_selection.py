"""Screen: top-k under SGD-momentum where every rank sends the same coordinates: the k largest of the ranks'
summed accumulations |acc_0 + ... + acc_{P-1}| (a selection agreed before the values travel, as gTop-k and
ScaleCom arrange it with an extra round of indices), each rank its own acc there, the rest kept in its
residual. Quality only: the bytes logged are the one-round payload's. Usage: STEPS LOG WORKLOAD"""
import sys

import torch

from experiments import simulate
from experiments.screening import run_prefix, topk_by_score
from gradcomp.compressors import topk

SCORE = {}


def main(stop, log, workload):
    torch.set_num_threads(1)

    def exchange(self):
        flats, handles = [], []
        for index, bucket in enumerate(self.buckets):
            accs = []
            per_rank = []
            for rank in range(self.world_size):
                params = [self._named[rank][i][1] for i in bucket]
                flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
                keys = [self._named[rank][i][0] for i in bucket]
                numels = [p.numel() for p in params]
                residual = self.engines[rank].residual_memory.buffers(keys, numels, flat.device)[0]
                accs.append(flat.float() + residual)
                per_rank.append(flat)
            SCORE["current"] = torch.stack(accs).sum(0).abs()
            for rank in range(self.world_size):
                flats.append((rank, bucket, per_rank[rank]))
                handles.append(self._start(rank, index, bucket, per_rank[rank]))
        SCORE.pop("current", None)
        for (rank, bucket, flat), handle in zip(flats, handles):
            engine = self.engines[rank]
            result = handle.work.value()[0]
            self._write_back(rank, bucket, engine.finish(handle, result))
        for engine in self.engines:
            engine.end_step()

    def compress(self, tensor, residual=None, residual_out=None, backend=None):
        return topk_by_score(self, tensor, residual, residual_out, lambda acc: SCORE["current"])

    simulate.Simulation.exchange = exchange
    topk.TopK.compress = compress
    run_prefix(stop, log, workload, "sgdm", "topk")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
