"""The token bucket (``tc ... tbf``) that gives an emulated link its rate: the rate's syntax, the
bucket's size, the queue in front of it and the sender's stack around it; and the commands that put
them on a namespace's device (:mod:`experiments.netem`, and :mod:`experiments.step_times`, which
changes a link's rate between rounds).

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
a sender that fills it is held back, where a shallow queue drops packets and each drop costs a
retransmission timeout (a 128 KB message at 10 Mbit/s behind a queue of 100 ms took 335 ms, against
104 ms behind this one). What a socket may hold in that queue, and how large a segmentation-offload
packet may be, the kernel sizes for the device's speed, which a shaped veth or loopback does not
have: a 64 KB packet is 52 ms of a 10 Mbit/s link, and the acknowledgements of the other direction
wait behind a socket's queued bytes, so that both ways at once the link ran 10-20 % under its rate.
:func:`stack_settings` keeps both to :data:`QUEUED_S` of the rate (a 1.75 MB allreduce of two ranks
at 10 Mbit/s: 1.49 s in every repeat, against 1.46 s at the rate and 1.52-1.82 s without).
"""
from __future__ import annotations

import math
import re
import subprocess
from typing import List, Optional, Sequence, Tuple

__all__ = ["parse_rate", "rate_bytes_per_s", "burst_bytes", "tbf_args", "stack_settings", "shape_device",
           "unshape_device", "default_queued", "limit_queued", "set_rate", "run", "UNSHAPED", "MTU",
           "BURST_S", "MIN_BURST", "LIMIT", "QUEUED_S", "GSO_MAX_SEGS", "MIN_QUEUED", "COMMAND_TIMEOUT_S"]

UNSHAPED = "unshaped"
#: The longest an ``ip`` or ``tc`` command may take.
COMMAND_TIMEOUT_S = 20.0
#: The MTU of every shaped device (the duplex link's veth ends and the shared link's loopback).
MTU = 1500
#: The most of the rate's time a message sent after a pause gains from the bucket's tokens.
BURST_S = 1e-3
#: The smallest bucket, in bytes: two packets of :data:`MTU` with their headers.
MIN_BURST = 4096
#: The queue in front of the bucket (tc's size syntax: 16 MiB).
LIMIT = "16mb"
#: The most of the rate's time one socket's queued bytes and one offload packet may take.
QUEUED_S = 4e-3
#: A device's segments per offload packet when nothing limits them (the kernel's default).
GSO_MAX_SEGS = 65535
#: The least a socket may queue: a few packets.
MIN_QUEUED = 8192
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


def stack_settings(rate: str, default_queued: int) -> Tuple[int, int]:
    """``(gso_max_segs, tcp_limit_output_bytes)`` for the shaped devices and the senders' namespaces of a link
    of ``rate``: an offload packet of at most :data:`QUEUED_S` of the rate (whole packets of :data:`MTU`, at
    least one) and a socket's queued bytes likewise (at least :data:`MIN_QUEUED`, at most ``default_queued``,
    the namespace's own); on fast links both are the kernel's defaults."""
    per_s = rate_bytes_per_s(rate)
    segments = min(GSO_MAX_SEGS, max(1, math.ceil(per_s * QUEUED_S / MTU)))
    return segments, min(default_queued, max(MIN_QUEUED, round(per_s * QUEUED_S)))


def run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """``argv`` (an ``ip`` or ``tc`` command), its output captured, within ``timeout`` seconds."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


def shape_device(namespace: str, device: str, rate: str, verb: str = "add") -> None:
    """``rate``'s bucket on ``device`` of ``namespace`` (``verb``: ``add`` or ``replace``), its offload packets
    sized to the rate."""
    run(["ip", "netns", "exec", namespace, "tc", "qdisc", verb, "dev", device, "root", *tbf_args(rate)])
    run(["ip", "-n", namespace, "link", "set", device, "gso_max_segs", str(stack_settings(rate, 0)[0])])


def unshape_device(namespace: str, device: str) -> None:
    """``device`` of ``namespace`` without a bucket (none to remove is fine), its offload packets the default."""
    run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"], check=False)
    run(["ip", "-n", namespace, "link", "set", device, "gso_max_segs", str(GSO_MAX_SEGS)])


def default_queued(namespace: str) -> int:
    """``namespace``'s ``net.ipv4.tcp_limit_output_bytes`` (the kernel's default in one this module never set)."""
    return int(run(["ip", "netns", "exec", namespace, "sysctl", "-n", "net.ipv4.tcp_limit_output_bytes"]).stdout)


def limit_queued(namespace: str, rate: Optional[str], default: int) -> None:
    """What a socket of ``namespace`` may queue: :func:`stack_settings`'s for ``rate``, ``default`` for ``None``."""
    value = default if rate is None else stack_settings(rate, default)[1]
    run(["ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"net.ipv4.tcp_limit_output_bytes={value}"])


def set_rate(rank_namespaces: Sequence[str], hub: str, device: str, rate: Optional[str]) -> None:
    """Change a duplex link (rank ``r``'s ``device`` in ``rank_namespaces[r]``, its peer ``h<r>`` in ``hub``) to
    ``rate`` (``None``: unshaped) on every end, the senders' stacks with it."""
    default = default_queued(hub)  # the hub sends nothing and keeps the kernel's default
    ends = [(name, device) for name in rank_namespaces] + [(hub, f"h{r}") for r in range(len(rank_namespaces))]
    for namespace, name in ends:
        _reshape(namespace, name, rate)
    for namespace in rank_namespaces:
        limit_queued(namespace, rate, default)


def set_shared_rate(namespace: str, rate: Optional[str], default: int) -> None:
    """Change a shared link (``namespace``'s loopback) to ``rate`` (``None``: unshaped), its senders' stack
    with it; ``default``: the kernel's own queue limit (the one for no rate)."""
    _reshape(namespace, "lo", rate)
    limit_queued(namespace, rate, default)


def _reshape(namespace: str, device: str, rate: Optional[str]) -> None:
    """``device`` of ``namespace`` to ``rate``'s bucket, in place of the one it has (``None``: no bucket)."""
    if rate is None:
        unshape_device(namespace, device)
    else:
        shape_device(namespace, device, rate, "replace")
