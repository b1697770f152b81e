"""Link emulation: run commands inside a private network namespace whose loopback is
rate-limited with ``tc ... tbf``, so local ranks talk over a link of a chosen speed.

How (as root)::

    ip netns add gcnetem-<pid>-<random>
    ip netns exec NAME ip link set lo up
    ip netns exec NAME tc qdisc add dev lo root tbf rate 1gbit burst 128kb latency 100ms
    ip netns exec NAME env GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 <command>
    ip netns del NAME                       # always, in a finally

The namespace has only its own loopback, so no traffic can leave the machine. Gloo needs
``GLOO_SOCKET_IFNAME=lo`` there (it otherwise resolves the hostname to an interface the
namespace lacks, and hangs).

What the emulated link is. All ranks share one loopback, so the ``tbf`` rate is the
*aggregate* rate of all traffic between ranks, in both directions together: with 2
ranks each sending at once, each gets about half. It is a shared medium of the given
rate, which is harsher than two full-duplex NICs of that rate. The ``burst`` of 128 KB
holds two 64 KB loopback packets; ``latency 100ms`` bounds the queue.

Without root, or when ``ip netns`` fails, :func:`link` falls back to the unshaped host
loopback, prints a loud warning, and marks the result (``link="unshaped"``,
``link_fallback=True``). Every subprocess here has a timeout.

Example::

    with link("1gbit") as shaped:
        run_bounded(shaped.command([sys.executable, "-m", "experiments.train"]), env=shaped.env(), timeout=600)

    python -m experiments.netem --rate 1gbit --check            # measure the shaped rate
    python -m experiments.netem --rate 100mbit -- python -m experiments.train ...
    python -m experiments.netem --clean                         # remove stale namespaces
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

PREFIX = "gcnetem"
UNSHAPED = "unshaped"
COMMAND_TIMEOUT_S = 20.0
TBF_BURST = "128kb"
TBF_LATENCY = "100ms"
# tc's rate syntax, restricted to plain numbers and units (the value goes to argv only,
# but a strict pattern gives a clear error for typos such as "1gb").
_RATE = re.compile(r"^[0-9]+(\.[0-9]+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+$")


@dataclass
class Link:
    """Where a command runs: a shaped namespace, or the unshaped host loopback.

    ``label`` is ``"unshaped"`` whenever no shaping is in effect, including a fallback;
    ``requested`` is the rate that was asked for; ``fallback_reason`` says why shaping
    could not be done (``None`` when it was done or not asked for).
    """

    label: str
    requested: Optional[str] = None
    namespace: Optional[str] = None
    fallback_reason: Optional[str] = None
    extra_env: Dict[str, str] = field(default_factory=dict)

    @property
    def shaped(self) -> bool:
        return self.namespace is not None

    @property
    def fallback(self) -> bool:
        return self.fallback_reason is not None

    def command(self, argv: Sequence[str]) -> List[str]:
        """``argv`` prefixed to run inside the namespace (unchanged when unshaped)."""
        if self.namespace is None:
            return list(argv)
        return ["ip", "netns", "exec", self.namespace, *argv]

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """``base`` (default ``os.environ``) plus what ranks need to talk over the loopback."""
        env = dict(os.environ if base is None else base)
        env.update({"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "GRADCOMP_LINK": self.label})
        if self.namespace is not None:
            env["GRADCOMP_NETNS"] = self.namespace
        else:
            env.pop("GRADCOMP_NETNS", None)
        env.update(self.extra_env)
        return env

    def record(self) -> dict:
        """Fields for a results record."""
        return {
            "link": self.label,
            "link_requested": self.requested or UNSHAPED,
            "shaped": self.shaped,
            "link_fallback": self.fallback,
            "link_fallback_reason": self.fallback_reason,
        }


def parse_rate(rate: Optional[str]) -> Optional[str]:
    """``None`` for no shaping (``None``, ``""``, ``"unshaped"``, ``"none"``), else the
    rate in tc syntax, lower-cased (``"1gbit"``); ``ValueError`` for anything else."""
    if rate is None or rate.strip().lower() in ("", UNSHAPED, "none"):
        return None
    rate = rate.strip().lower()
    if not _RATE.match(rate):
        raise ValueError(f"link rate {rate!r} is not a tc rate such as 1gbit, 100mbit or 10gbit (or 'unshaped')")
    return rate


def _run(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=check)


def shaping_unavailable_reason() -> Optional[str]:
    """Why shaping cannot be attempted here (``None``: it can be)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (network namespaces and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    return None


def list_namespaces() -> List[str]:
    """Names of this machine's network namespaces (empty if ``ip`` cannot tell)."""
    try:
        listing = _run(["ip", "netns", "list"], check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale() -> List[str]:
    """Delete namespaces of ours (``gcnetem-<pid>-...``) whose creating process is gone;
    those of live processes (a concurrent run) are left alone. Returns the deleted names."""
    removed = []
    for name in list_namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


def _namespace_pids(name: str) -> List[int]:
    try:
        listing = _run(["ip", "netns", "pids", name], check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(word) for word in listing.stdout.split() if word.isdigit()]


def _delete(name: str) -> None:
    # Processes left in the namespace (ours: only we run commands there) would keep it
    # alive after `ip netns del`; stop them by pid first.
    for pid in _namespace_pids(name):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        _run(["ip", "netns", "del", name], check=False)


def warn_unshaped(requested: str, reason: str) -> None:
    """The loud warning printed when shaping was asked for and is not in effect."""
    bar = "!" * 78
    message = textwrap.fill(
        f"netem: could not shape the link to {requested}: {reason}. Running on the UNSHAPED "
        "host loopback instead; step times will NOT reflect that link, and results are "
        "labelled link=unshaped, link_fallback=true.",
        width=76,
    )
    print(f"\n{bar}\n{message}\n{bar}\n", file=sys.stderr, flush=True)


def _create(name: str, rate: str) -> None:
    _run(["ip", "netns", "add", name])
    _run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"])
    _run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
          "rate", rate, "burst", TBF_BURST, "latency", TBF_LATENCY])  # fmt: skip


@contextlib.contextmanager
def link(rate: Optional[str]) -> Iterator[Link]:
    """A :class:`Link` at ``rate`` (``None``/``"unshaped"``: the host loopback) for the
    duration of the ``with``; the namespace is always deleted afterwards.

    Falls back to the unshaped loopback, with :func:`warn_unshaped`, when not root or
    when creating the namespace fails.
    """
    rate = parse_rate(rate)
    if rate is None:
        yield Link(label=UNSHAPED)
        return
    reason = shaping_unavailable_reason()
    if reason is not None:
        warn_unshaped(rate, reason)
        yield Link(label=UNSHAPED, requested=rate, fallback_reason=reason)
        return
    clean_stale()
    name = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        try:
            _create(name, rate)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", None) or str(error)
            reason = f"creating the namespace failed ({detail.strip()})"
            warn_unshaped(rate, reason)
            _delete(name)
            yield Link(label=UNSHAPED, requested=rate, fallback_reason=reason)
            return
        yield Link(label=rate, requested=rate, namespace=name)
    finally:
        if name in list_namespaces():
            _delete(name)


def run_bounded(argv: Sequence[str], timeout: float, env: Optional[Dict[str, str]] = None, **popen_kwargs) -> int:
    """Run ``argv`` in its own process group; on timeout stop that whole group (the
    command and the ranks it spawned) and return 124. Otherwise its exit status."""
    process = subprocess.Popen(list(argv), env=env, start_new_session=True, **popen_kwargs)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop_group(process)
        return 124
    except BaseException:
        _stop_group(process)
        raise


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.netem",
        description="Run a command over an emulated link (a tbf-shaped loopback in a private namespace)."
    )
    parser.add_argument("--rate", default=UNSHAPED, help="tc rate such as 1gbit, 100mbit; 'unshaped' for none")
    parser.add_argument("--check", action="store_true", help="measure the link's TCP throughput")
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
    with link(args.rate) as shaped:
        print(f"netem: link={shaped.label} namespace={shaped.namespace or '-'}", file=sys.stderr, flush=True)
        if args.check:
            print(f"netem: one TCP stream over the link: {measure_gbit_s(shaped):.3f} Gbit/s", flush=True)
        if command:
            return run_bounded(shaped.command(command), timeout=args.timeout, env=shaped.env())
    return 0


if __name__ == "__main__":
    sys.exit(main())
