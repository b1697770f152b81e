"""Validation of the scaling study's cost model (:mod:`experiments.scaling`) on real Gloo ranks of this machine.

Run through the study's command line::

    python -m experiments.scaling --measure --out DIR [--links unshaped,1gbit] [--world-sizes 2,4]

For each link (``1gbit``: a private network namespace shaped by :mod:`experiments.netem`, as
root; else it falls back to unshaped and says so) and each P, ranks first calibrate the link
(alpha from 8-byte and beta from 16 MB ping-pongs between ranks 0 and 1), then time the
collectives of each exchange with the exact byte sizes the engine hands over, and the whole
engine exchange (compress, collectives, validate, decode) for allgather and two-phase.
All ranks of the emulated link share one medium (netem's docstring), so the model is given
a per-flow bandwidth of ``beta / P`` when P ranks send at once. Writes ``validation.json``
and ``validation.md`` (predicted vs measured, ratio). Timings need an idle machine.

:func:`measure` drives the runs, one ``python -m experiments.scaling --measure-worker`` subprocess
per link and P (inside the shaped namespace when there is one); :func:`measure_worker` spawns that
run's ranks (:func:`_measure_rank`); :func:`predictions_for` gives the model's figures for a record.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch

from experiments import launch
from experiments.scaling import COMPRESSED, DENSE, FLAT, SUMMED, kernels_for
from gradcomp import FP16, inflight
from gradcomp.costmodel import Cluster, Link, predict

VALIDATION_NUMEL = 4 * 1024 * 1024  # 16 MB of float32: bandwidth-dominated, seconds on loopback
REPEATS = 5


def _all_reduce_held(tensor: torch.Tensor) -> None:
    """A blocking allreduce of ``tensor``, held until Gloo's thread lets go (see gradcomp.inflight)."""
    import torch.distributed as dist

    (handed,) = inflight.hold(tensor)
    dist.all_reduce(handed)


def _median_time(fn, repeats: int, fresh=None) -> float:
    """The median over ``repeats`` of ``fn()`` (after a warm-up call), ranks lined up by a barrier before each;
    with ``fresh``, each call is ``fn(fresh())``, ``fresh()`` run outside the timed region (a copy of the input
    that ``fn`` mutates: a pass over it that is the benchmark's, not the exchange's)."""
    import torch.distributed as dist

    call = fn if fresh is None else (lambda: fn(fresh()))
    call()  # warm-up
    times = []
    for _ in range(repeats):
        arguments = () if fresh is None else (fresh(),)
        dist.barrier()
        started = time.perf_counter()
        fn(*arguments)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _pingpong(nbytes: int, repeats: int) -> float:
    """Half the median round trip of ``nbytes`` between ranks 0 and 1 (others wait)."""
    import torch.distributed as dist

    buffer = torch.zeros(nbytes, dtype=torch.uint8)

    def once():
        if dist.get_rank() == 0:
            dist.send(buffer, 1)
            dist.recv(buffer, 1)
        elif dist.get_rank() == 1:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)

    return _median_time(once, repeats) / 2


def _measure_rank(rank: int, world_size: int, numel: int, repeats: int, out: str) -> None:
    """One rank of a measured run (not a training run: collectives timed one by one); rank 0 writes ``out``."""
    import torch.distributed as dist

    from gradcomp.engine import Engine
    from gradcomp.hooks.ddp import TorchDistributedTransport

    launch.init_rank(rank, world_size, threads=1, timeout=300, cuda=False)
    try:
        alpha = _pingpong(8, repeats * 4)
        big = 16 << 20
        beta = big / max(_pingpong(big, repeats) - alpha, 1e-9)
        measured: Dict[str, float] = {}
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        measured[DENSE] = _median_time(_all_reduce_held, repeats, grad.clone)
        half = grad.half()
        measured["fp16"] = _median_time(_all_reduce_held, repeats, half.clone)
        cluster = Cluster(world_size, Link(alpha, beta))
        for _, name, factory in COMPRESSED:
            compressor = factory()
            for exchange in FLAT:
                cost = predict(exchange, compressor, numel, cluster)
                measured[f"{name} {exchange}"] = _median_time(_collectives_of(cost, world_size), repeats)
            for exchange in FLAT:
                engine = Engine(compressor, TorchDistributedTransport(), warmup_steps=0, min_numel=0,
                                exchange=exchange)

                def engine_step(own):
                    handle = engine.start(own, ("g",), (numel,), 0)
                    engine.finish(handle, handle.work.wait()[0])
                    engine.end_step()

                measured[f"{name} {exchange} engine"] = _median_time(engine_step, repeats, grad.clone)
        if rank == 0:
            with open(out, "w") as handle:
                json.dump({"world_size": world_size, "numel": numel, "alpha_s": alpha, "beta_Bps": beta,
                           "measured_s": measured}, handle)
    finally:
        dist.destroy_process_group()


def _collectives_of(cost, world_size: int):
    """What runs the collectives ``cost`` charges for (zero bytes of its sizes): an allgather of the
    payload, or an all-to-all of chunk slots and an allgather of the re-compressed slot."""
    import torch.distributed as dist

    if "slot1" not in cost.parts:
        payload = torch.zeros(cost.handed_bytes, dtype=torch.uint8)
        gathered = torch.empty(world_size * cost.handed_bytes, dtype=torch.uint8)
        # Held aliases for the exit, as every tensor handed to Gloo (gradcomp.inflight).
        sent, received = inflight.hold(payload, gathered)
        return lambda: dist.all_gather_into_tensor(received, sent)
    slot1, slot2 = cost.parts["slot1"], cost.parts["slot2"]
    a2a_in = torch.zeros(world_size * slot1, dtype=torch.uint8)
    a2a_out = torch.empty_like(a2a_in)
    second = torch.zeros(slot2, dtype=torch.uint8)
    second_out = torch.empty(world_size * slot2, dtype=torch.uint8)
    a2a_in, a2a_out, second, second_out = inflight.hold(a2a_in, a2a_out, second, second_out)

    def chunked():
        dist.all_to_all_single(a2a_out, a2a_in)
        dist.all_gather_into_tensor(second_out, second)

    return chunked


def measure_worker(world_size: int, numel: int, repeats: int, out: str, timeout_s: float = 3600.0) -> int:
    """Spawn ``world_size`` Gloo ranks here (inside the shaped namespace when there is one); the exit status."""
    return launch.spawn_ranks(_measure_rank, world_size, (numel, repeats, out), max_time=timeout_s, name="scaling")


def predictions_for(record: dict, bench: Optional[str]) -> Dict[str, float]:
    """The model's figures for one measured record (its own calibrated alpha and beta)."""
    p, numel = record["world_size"], record["numel"]
    # P ranks sending at once share one medium (loopback; netem's shaped loopback).
    cluster = Cluster(p, Link(record["alpha_s"], record["beta_Bps"] / p))
    predicted = {DENSE: predict(DENSE, None, numel, cluster).comm_s,
                 "fp16": predict(SUMMED, FP16(), numel, cluster).comm_s}
    for _, name, factory in COMPRESSED:
        compressor = factory()
        for exchange in FLAT:
            cost = predict(exchange, compressor, numel, cluster, kernels_for(exchange, factory, bench))
            predicted[f"{name} {exchange}"] = cost.comm_s
            predicted[f"{name} {exchange} engine"] = cost.total_s
    return predicted


def measure(out_dir: str, links: Sequence[str], world_sizes: Sequence[int], numel: int, repeats: int,
            bench: Optional[str], timeout_s: float) -> List[dict]:
    from experiments import netem

    load = os.getloadavg()[0]  # before the ranks add their own
    records = []
    for rate in links:
        with netem.link(None if rate == netem.UNSHAPED else rate) as shaped:
            for p in world_sizes:
                path = os.path.join(out_dir, f"measured_{shaped.label}_p{p}.json")
                argv = [sys.executable, "-m", "experiments.scaling", "--measure-worker", "--world-size", str(p),
                        "--numel", str(numel), "--repeats", str(repeats), "--json", path]
                code = launch.run_bounded(shaped.command(argv), timeout=timeout_s, env=shaped.env())
                if code != 0 or not os.path.exists(path):
                    records.append({"link": shaped.label, "world_size": p, "error": f"exit code {code}"})
                    continue
                with open(path) as handle:
                    record = json.load(handle)
                record.update(shaped.record())
                record["predicted_s"] = predictions_for(record, bench)
                records.append(record)
    with open(os.path.join(out_dir, "validation.json"), "w") as handle:
        json.dump(records, handle, indent=1)
    lines = ["# Cost model vs measured exchange time (this machine, loopback)", "",
             f"n = {numel} float32; median of {repeats}; load average at start "
             f"{load:.2f}; kernel rates {'left out' if bench is None else 'of ' + os.path.relpath(bench)}. "
             "alpha, beta calibrated per run by ping-pong between ranks 0 and 1; "
             "per-flow bandwidth beta / P (one shared medium).", "",
             "| link | P | exchange | predicted s | measured s | measured / predicted |", "|---|---|---|---|---|---|"]
    for record in records:
        if "error" in record:
            lines.append(f"| {record['link']} | {record['world_size']} | (failed: {record['error']}) | | | |")
            continue
        for name, seconds in record["measured_s"].items():
            predicted = record["predicted_s"][name]
            lines.append(f"| {record['link']} | {record['world_size']} | {name} | {predicted:.4g} | {seconds:.4g} | "
                         f"{seconds / predicted:.2f} |")
    with open(os.path.join(out_dir, "validation.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    return records
