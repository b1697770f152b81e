"""The token bucket (``tc ... tbf``) that gives an emulated link its rate: the rate's syntax, the
bucket's size and the queue in front of it (:mod:`experiments.netem`).

A token bucket lets through at once whatever its tokens cover, and its tokens refill at the rate
while the link is idle. A link of rate ``R`` moves a message of ``S`` bytes in ``S / R`` whether it
was idle before or not, so the bucket holds no more than :data:`BURST_S` of the rate's bytes, and
at least :data:`MIN_BURST` (two packets of :data:`MTU`: the devices of the emulated links carry
Ethernet's MTU, and a packet larger than the bucket would never pass). What that leaves a message
sent after a pause: at most ``max(BURST_S, MIN_BURST / R)`` less than the rate gives, 1 ms from
4 Mbit/s up, 3.3 ms at 10 Mbit/s. (A fixed bucket of 128 KB, this module's predecessor, let a
64 KB payload cross a 10 Mbit/s link in 0.2 ms after a pause of 0.3 s, against 51 ms at the rate,
so that a method sending a few KB between the steps of others ran as if unshaped.)

The queue in front of the bucket is :data:`LIMIT` bytes deep, as a host's own interface queue is:
a sender that fills it is held back (TCP's small-queue limit keeps a socket's share of it), where
a shallow queue drops packets and each drop costs a retransmission timeout (a 128 KB message at
10 Mbit/s behind a queue of 100 ms took 335 ms, against 104 ms behind this one).
"""
from __future__ import annotations

import re
from typing import List, Optional

__all__ = ["parse_rate", "rate_bytes_per_s", "burst_bytes", "tbf_args", "UNSHAPED", "MTU", "BURST_S", "MIN_BURST",
           "LIMIT"]

UNSHAPED = "unshaped"
#: The MTU of every shaped device (the duplex link's veth ends and the shared link's loopback).
MTU = 1500
#: The most of the rate's time a message sent after a pause gains from the bucket's tokens.
BURST_S = 1e-3
#: The smallest bucket, in bytes: two packets of :data:`MTU` with their headers.
MIN_BURST = 4096
#: The queue in front of the bucket (tc's size syntax: 16 MiB).
LIMIT = "16mb"
# tc's rate syntax, restricted to plain numbers and units (the value goes to argv only,
# but a strict pattern gives a clear error for typos such as "1gb").
_RATE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
# tc's units: "...bit" are bits a second, "...bps" bytes a second; the prefixes are decimal.
_BYTES_PER_UNIT = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
                   "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}


def parse_rate(rate: Optional[str]) -> Optional[str]:
    """``None`` for no shaping (``None``, ``""``, ``"unshaped"``, ``"none"``), else the
    rate in tc syntax, lower-cased (``"1gbit"``); ``ValueError`` for anything else."""
    if rate is None or rate.strip().lower() in ("", UNSHAPED, "none"):
        return None
    rate = rate.strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 1gbit, 100mbit or 10gbit (or 'unshaped')")
    return rate


def rate_bytes_per_s(rate: str) -> float:
    """Bytes a second of a tc ``rate`` (``"100mbit"`` -> 12.5e6; ``"100mbps"``, bytes, -> 1e8)."""
    match = _RATE.match(rate.strip().lower())
    if match is None:
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 1gbit, 100mbit or 10gbit")
    return float(match.group(1)) * _BYTES_PER_UNIT[match.group(2)]


def burst_bytes(rate: str) -> int:
    """The bucket of a link of ``rate``: :data:`BURST_S` of its bytes, at least :data:`MIN_BURST`."""
    return max(MIN_BURST, round(rate_bytes_per_s(rate) * BURST_S))


def tbf_args(rate: str) -> List[str]:
    """What follows ``tc qdisc add|replace dev DEV root`` for a link of ``rate``."""
    return ["tbf", "rate", rate, "burst", str(burst_bytes(rate)), "limit", LIMIT]
