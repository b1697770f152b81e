"""Throughput probes of an emulated link (:mod:`experiments.netem`): what rate a link really has;
and the command line that runs a command over such a link.

* :func:`measure_gbit_s`: one TCP stream over a shared link's loopback.
* :func:`measure_duplex_gbit_s`: between the rank namespaces of a full-duplex link, one way or
  both ways at once.
* :func:`message_seconds`: how long one message takes from rank 0 to rank 1 of a full-duplex link
  after the link was idle (what a token bucket's stored tokens would shorten).

The tests use them to show that a shaped link has the rate asked for.

:func:`main` is the command line of :mod:`experiments.netem` (run as ``python -m experiments.netem``):
run a command over an emulated link, ``--check`` to print the probes' rates, ``--clean`` to remove
stale namespaces.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from typing import List

from experiments.netem import LINK_MODES, UNSHAPED, Link, clean_stale, link, parse_rate

__all__ = ["measure_gbit_s", "measure_duplex_gbit_s", "message_seconds", "main"]


# A throughput probe that runs inside the link: one TCP stream over 127.0.0.1.
_PROBE = r"""
import socket, sys, threading, time
total = int(sys.argv[1])
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen(1)
received = [0]
def sink():
    conn, _ = server.accept()
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        received[0] += len(data)
thread = threading.Thread(target=sink); thread.start()
client = socket.create_connection(server.getsockname())
chunk = b"\0" * (1 << 20)
start = time.perf_counter()
sent = 0
while sent < total:
    client.sendall(chunk); sent += len(chunk)
client.shutdown(socket.SHUT_WR); thread.join(); elapsed = time.perf_counter() - start
print(received[0] * 8 / elapsed / 1e9)
"""


def measure_gbit_s(shaped: Link, nbytes: int = 64 << 20, timeout: float = 60.0) -> float:
    """Throughput of one TCP stream over ``shaped``'s loopback, in Gbit/s."""
    result = subprocess.run(
        shaped.command([sys.executable, "-c", _PROBE, str(nbytes)]),
        capture_output=True, text=True, timeout=timeout, check=True, env=shaped.env(),
    )  # fmt: skip
    return float(result.stdout.strip().splitlines()[-1])


# A duplex probe, run as one process per rank namespace: it receives on its own address
# (when told to) and sends ``total`` bytes to the peer's; prints the Gbit/s it received at.
_DUPLEX_PROBE = r"""
import socket, sys, threading, time
own, peer, total, send, receive = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
PORT = 5201
server = socket.socket(); server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((own, PORT)); server.listen(1); server.settimeout(60)
rate = [0.0]
def sink():
    conn, _ = server.accept(); conn.settimeout(60)
    received, start = 0, None
    while True:
        data = conn.recv(1 << 20)
        if not data:
            break
        start = start or time.perf_counter()
        received += len(data)
    rate[0] = received * 8 / (time.perf_counter() - start) / 1e9
thread = threading.Thread(target=sink)
if receive:
    thread.start()
if send:
    deadline = time.monotonic() + 30
    while True:
        try:
            client = socket.create_connection((peer, PORT), timeout=60); break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    chunk, sent = b"\0" * (1 << 16), 0
    while sent < total:
        client.sendall(chunk); sent += len(chunk)
    client.shutdown(socket.SHUT_WR); client.recv(1); client.close()
if receive:
    thread.join(90)
print(rate[0])
"""


def measure_duplex_gbit_s(shaped: Link, nbytes: int = 4 << 20, both: bool = True, timeout: float = 90.0) -> List[float]:
    """Received Gbit/s between ranks 0 and 1 of a duplex ``shaped``: ``[1 -> 0, 0 -> 1]`` when
    ``both`` directions run at once, ``[0 -> 1]`` alone otherwise. Each rate is measured by its
    receiver from its first byte to the sender's end of stream."""
    if len(shaped.rank_namespaces) < 2:
        raise ValueError("measure_duplex_gbit_s needs a duplex link of at least 2 ranks")
    argv = lambda rank, send, receive: shaped.rank_command(rank, [  # noqa: E731
        sys.executable, "-c", _DUPLEX_PROBE, Link.address(rank), Link.address(1 - rank), str(nbytes),
        "1" if send else "0", "1" if receive else "0"])
    processes = [subprocess.Popen(argv(1, both, True), stdout=subprocess.PIPE, text=True),
                 subprocess.Popen(argv(0, True, both), stdout=subprocess.PIPE, text=True)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    if any(p.returncode for p in processes):
        raise RuntimeError(f"the duplex probe failed: exit {[p.returncode for p in processes]}")
    rates = [float(out.strip().splitlines()[-1]) for out in outputs]  # [rank 1 received, rank 0 received]
    return [rates[1], rates[0]] if both else [rates[0]]


# One message after a pause, as a rank between two steps: rank 1 acknowledges each message of
# ``n`` bytes (an 8-byte length first) with one byte; rank 0 sleeps ``gap`` seconds before each.
_MESSAGE_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5202)); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.settimeout(60); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    head = c.recv(8, socket.MSG_WAITALL)
    if len(head) < 8:
        break
    n, got = int.from_bytes(head, "little"), 0
    while got < n:
        data = c.recv(min(1 << 20, n - got))
        if not data:
            raise SystemExit(1)
        got += len(data)
    c.sendall(b"k")
"""
_MESSAGE_CLIENT = r"""
import socket, statistics, sys, time
peer, sizes, gap, repeats = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3]), int(sys.argv[4])
deadline = time.monotonic() + 30
while True:
    try:
        c = socket.create_connection((peer, 5202), timeout=60); break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for n in sizes:
    seconds = []
    for _ in range(repeats):
        time.sleep(gap)
        start = time.perf_counter(); c.sendall(n.to_bytes(8, "little") + bytes(n)); c.recv(1)
        seconds.append(time.perf_counter() - start)
    print(statistics.median(seconds))
"""


def message_seconds(shaped: Link, sizes: List[int], gap: float = 0.3, repeats: int = 3,
                    timeout: float = 120.0) -> List[float]:
    """Per size in ``sizes`` (bytes), the median seconds of ``repeats`` messages from rank 0 to rank 1 of a
    duplex ``shaped``, each sent ``gap`` seconds after the last one was acknowledged."""
    if len(shaped.rank_namespaces) < 2:
        raise ValueError("message_seconds needs a duplex link of at least 2 ranks")
    server = subprocess.Popen(shaped.rank_command(1, [sys.executable, "-c", _MESSAGE_SERVER, Link.address(1)]))
    try:
        client = subprocess.run(shaped.rank_command(0, [
            sys.executable, "-c", _MESSAGE_CLIENT, Link.address(1), ",".join(map(str, sizes)), str(gap),
            str(repeats)]), capture_output=True, text=True, timeout=timeout, check=True)
    finally:
        server.kill()
        server.wait(10)
    return [float(line) for line in client.stdout.split()]


def main(argv=None) -> int:
    """``python -m experiments.netem``: run a command over an emulated link; the command's exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.netem",
        description="Run a command over an emulated link (a tbf-shaped loopback in a private namespace)."
    )
    parser.add_argument("--rate", default=UNSHAPED, help="tc rate such as 1gbit, 100mbit; 'unshaped' for none")
    parser.add_argument("--check", action="store_true", help="measure the link's TCP throughput")
    parser.add_argument("--link-mode", choices=LINK_MODES, default="shared",
                        help="shared: one shaped loopback for all ranks (the rate is their sum); duplex: a namespace "
                             "per rank joined by veth pairs, each direction shaped at the rate")
    parser.add_argument("--ranks", type=int, default=2, help="duplex: how many rank namespaces")
    parser.add_argument("--clean", action="store_true", help="delete stale gcnetem-* namespaces and exit")
    parser.add_argument("--timeout", type=float, default=3600.0, help="limit for the command, seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run inside the link")
    args = parser.parse_args(argv)
    if args.clean:
        print("removed:", " ".join(clean_stale()) or "nothing")
        return 0
    try:
        parse_rate(args.rate)
    except ValueError as error:
        parser.error(str(error))
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    from experiments.launch import run_bounded

    with link(args.rate, args.link_mode, args.ranks) as shaped:
        where = shaped.namespace or ",".join(shaped.rank_namespaces) or "-"
        print(f"netem: link={shaped.label} mode={shaped.mode} namespace={where}", file=sys.stderr, flush=True)
        if args.check and shaped.rank_namespaces:
            alone = measure_duplex_gbit_s(shaped, 64 << 20, both=False)[0]
            both = measure_duplex_gbit_s(shaped, 64 << 20, both=True)
            print(f"netem: rank 0 -> 1 alone {alone:.3f} Gbit/s; both at once: 1 -> 0 {both[0]:.3f}, "
                  f"0 -> 1 {both[1]:.3f} Gbit/s", flush=True)
        elif args.check:
            print(f"netem: one TCP stream over the link: {measure_gbit_s(shaped):.3f} Gbit/s", flush=True)
        if command:
            return run_bounded(shaped.command(command), timeout=args.timeout, env=shaped.env())
    return 0
