"""The test harness's ports (tests/support/grpc_server.free_port): roles are told a port before they bind it, so the
port must not be one an outgoing connection could take meanwhile."""
from __future__ import annotations

import socket

from support.grpc_server import _ephemeral_range, free_port


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, high = _ephemeral_range()
    ports = [free_port() for _ in range(64)]
    assert len(set(ports)) == len(ports)
    if low - max(10000, low - 8192) >= 1024:  # else the host leaves no room below its range: bind(0)'s ports
        assert all(max(10000, low - 8192) <= p < low for p in ports), (low, high, sorted(ports))
    for port in ports[:8]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
