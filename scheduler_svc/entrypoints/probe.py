"""`nanoserve probe`: the container health checks of the roles that serve no gRPC. The scheduler is
healthy while it listens on its ZMQ ports; an executor while it holds a connection to the scheduler's
port (ZMQ reconnects by itself after the scheduler restarts). Stdlib only: it reads /proc/net/tcp."""
from __future__ import annotations

import argparse

LISTEN, ESTABLISHED = "0A", "01"  # TCP states as /proc/net/tcp spells them


def tcp_sockets() -> list[tuple[int, int, str]]:
    """(local port, remote port, state) of every TCP socket in this network namespace, IPv4 and IPv6."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            local, remote, state = row[1], row[2], row[3]
            found.append((int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state))
    return found


def missing(listening: list[int], connected: list[int]) -> list[str]:
    """What the probe asked for and did not find, in words; [] when healthy."""
    sockets = tcp_sockets()
    listens = {local for local, _, state in sockets if state == LISTEN}
    peers = {remote for _, remote, state in sockets if state == ESTABLISHED}
    return ([f"nothing listens on port {p}" for p in listening if p not in listens]
            + [f"no connection to port {p}" for p in connected if p not in peers])


def add_probe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listening", type=int, nargs="*", default=[], metavar="PORT",
                        help="ports that a socket here must listen on (the scheduler's)")
    parser.add_argument("--connected", type=int, nargs="*", default=[], metavar="PORT",
                        help="remote ports that a socket here must be connected to (an executor's scheduler)")


def run_probe(args: argparse.Namespace) -> int:
    problems = missing(args.listening, args.connected)
    print("; ".join(problems) or "ok")
    return 1 if problems else 0
