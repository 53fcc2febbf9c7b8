"""Node-to-node TCP reachability for the preflight (stdlib only; run with the venv's Python).

    tcpcheck.py listen --addr A --ports P[,P...] --range MIN:MAX --expect N --timeout S --ready FILE
    tcpcheck.py connect --src A --targets JSON --timeout S

`listen` binds every port on the training address (a busy port inside the Gloo range is swapped
for the nearest free one), writes {"ports": [...]} to FILE, answers each connection with its
host name, and exits after N connections or S seconds. `connect` connects from the training
address to each target and prints one JSON list: {"host", "addr", "port", "what", "ok", "error"}.
A target with "connect_only" (a port a running trainer holds) is only connected to: no hello is
sent, none awaited.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import socket
import sys
import time


def bind(addr: str, port: int, low: int, high: int) -> socket.socket | None:
    candidates = [port]
    if low <= port <= high:  # inside the Gloo range any free port proves the same rule
        step = -1 if port == high else 1
        candidates += [p for p in range(port + step, port + 50 * step, step) if low <= p <= high]
    for candidate in candidates:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, candidate))
            s.listen(64)
            return s
        except OSError as exc:
            s.close()
            if exc.errno != errno.EADDRINUSE:
                raise
    return None


def listen(args: argparse.Namespace) -> int:
    low, high = (int(x) for x in args.range.split(":"))
    socks, ports, busy = [], [], []
    for port in (int(p) for p in args.ports.split(",") if p):
        s = bind(args.addr, port, low, high)
        if s is None:
            busy.append(port)
        else:
            socks.append(s)
            ports.append(s.getsockname()[1])
    tmp = args.ready + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"ports": ports, "busy": busy, "addr": args.addr}, f)
    os.replace(tmp, args.ready)
    hello = (socket.gethostname() + "\n").encode()
    seen = 0
    deadline = time.monotonic() + args.timeout
    while seen < args.expect and time.monotonic() < deadline:
        ready, _, _ = select.select(socks, [], [], max(0.0, deadline - time.monotonic()))
        for s in ready:
            conn, _ = s.accept()
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(256)
                    conn.sendall(hello)
                except OSError:
                    pass
            seen += 1
    for s in socks:
        s.close()
    print(json.dumps({"accepted": seen, "expected": args.expect}))
    return 0


def connect(args: argparse.Namespace) -> int:
    results = []
    me = socket.gethostname()
    for t in json.loads(args.targets):
        r = dict(t, ok=False, error="")
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(args.timeout)
        try:
            s.bind((args.src, 0))
            s.connect((t["addr"], int(t["port"])))
            if not t.get("connect_only"):  # a running trainer's port: reached is enough, it is sent nothing
                s.sendall((me + "\n").encode())
                s.recv(256)
            r["ok"] = True
        except TimeoutError:
            r["error"] = f"timed out after {args.timeout:g}s (dropped: a firewall, or no route from {args.src})"
        except OSError as exc:
            r["error"] = f"{exc.strerror or exc} (errno {exc.errno})"
        finally:
            s.close()
        results.append(r)
    print(json.dumps(results))
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("listen")
    pl.add_argument("--addr", required=True)
    pl.add_argument("--ports", required=True)
    pl.add_argument("--range", required=True)
    pl.add_argument("--expect", type=int, required=True)
    pl.add_argument("--timeout", type=float, default=60)
    pl.add_argument("--ready", required=True)
    pc = sub.add_parser("connect")
    pc.add_argument("--src", required=True)
    pc.add_argument("--targets", required=True)
    pc.add_argument("--timeout", type=float, default=5)
    args = p.parse_args()
    return listen(args) if args.cmd == "listen" else connect(args)


if __name__ == "__main__":
    sys.exit(main())
