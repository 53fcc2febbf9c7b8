"""The preflight's TCP helper (roles/preflight/files/tcpcheck.py) against real sockets on loopback.

A port a running trainer holds (a node joining a run that goes on checks it can reach the
master's rendezvous port) is only connected to: nothing is sent into the trainer's store, and no
answer is awaited from it, which a store never gives."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

TCPCHECK = Path(__file__).resolve().parents[1] / "roles" / "preflight" / "files" / "tcpcheck.py"


def silent_server() -> tuple[socket.socket, list[bytes]]:
    """A listener that accepts and records what it is sent, and never answers (as a TCPStore)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    got: list[bytes] = []
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            held.append(conn)  # kept open, unanswered, until the test ends
            conn.settimeout(3)
            try:
                got.append(conn.recv(256))
            except OSError:
                got.append(b"")
    threading.Thread(target=serve, daemon=True).start()
    return srv, got


def connect(target: dict) -> dict:
    out = subprocess.run([sys.executable, str(TCPCHECK), "connect", "--src", "127.0.0.1", "--timeout", "1",
                          "--targets", json.dumps([target])], capture_output=True, text=True, check=True, timeout=30)
    return json.loads(out.stdout)[0]


def test_connect_only_reaches_a_port_that_never_answers_and_sends_it_nothing() -> None:
    srv, got = silent_server()
    port = srv.getsockname()[1]
    try:
        target = {"host": "node0", "addr": "127.0.0.1", "port": port, "what": "rendezvous port"}
        held = connect({**target, "connect_only": True})
        assert held["ok"], held
        hello = connect(target)  # the node-to-node check: a hello, and an answer awaited
        assert not hello["ok"] and "timed out" in hello["error"], hello
    finally:
        srv.close()
    assert got[0] == b"", f"connect_only sent the held port {got[0]!r}"
    assert got[1], "the plain check sent no hello"
