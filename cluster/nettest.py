#!/usr/bin/env python3
"""Measure a TCP transfer between two hosts with nothing but the standard library.

    nettest.py recv --port 5201 [--bind 0.0.0.0] [--count N] [--idle-timeout S]
    nettest.py send --host 10.77.0.10 --port 5201 --mbytes 20

`send` connects, sends MBYTES, waits for the receiver's byte count and prints one JSON line:
{"bytes": ..., "seconds": ..., "mbit_per_s": ...}. Used by the molecule verifiers and
cluster/README.md to show that nodes reach each other and that node_bandwidth shaping applies.
"""

import argparse
import json
import socket
import sys
import time

CHUNK = 64 * 1024


def recv(args: argparse.Namespace) -> int:
    with socket.create_server((args.bind, args.port), family=socket.AF_INET, reuse_port=False) as srv:
        print(f"listening on {args.bind}:{args.port}", file=sys.stderr, flush=True)
        srv.settimeout(args.idle_timeout or None)
        served = 0
        while True:
            try:
                conn, peer = srv.accept()
            except TimeoutError:
                print(f"no sender for {args.idle_timeout} s: giving up", file=sys.stderr)
                return 1
            conn.settimeout(None)
            with conn:
                header = b""
                while len(header) < 8 and (data := conn.recv(8 - len(header))):
                    header += data
                want = int.from_bytes(header, "big") if len(header) == 8 else 0
                total = 0
                while total < want and (data := conn.recv(min(CHUNK, want - total))):
                    total += len(data)
                conn.sendall(f"{total}\n".encode())
            print(f"received {total} bytes from {peer[0]}", file=sys.stderr, flush=True)
            served += 1
            if args.count and served >= args.count:
                return 0


def send(args: argparse.Namespace) -> int:
    payload = b"x" * CHUNK
    n = int(args.mbytes * 1e6)
    t0 = time.monotonic()
    try:
        s = socket.create_connection((args.host, args.port), timeout=args.timeout)
    except OSError as e:
        print(f"nettest: cannot connect to {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    with s:
        s.sendall(n.to_bytes(8, "big"))
        sent = 0
        while sent < n:
            chunk = payload[: min(CHUNK, n - sent)]
            s.sendall(chunk)
            sent += len(chunk)
        reply = s.makefile().readline().strip()
    dt = time.monotonic() - t0
    print(
        json.dumps(
            {
                "bytes": sent,
                "acked": int(reply or 0),
                "seconds": round(dt, 3),
                "mbit_per_s": round(sent * 8 / dt / 1e6, 1),
            }
        )
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--port", type=int, default=5201)
    r.add_argument("--count", type=int, default=0, help="exit after this many transfers (0: never)")
    r.add_argument("--idle-timeout", type=float, default=0, help="exit 1 after this long without a sender")
    s = sub.add_parser("send")
    s.add_argument("--host", required=True)
    s.add_argument("--port", type=int, default=5201)
    s.add_argument("--mbytes", type=float, default=20)
    s.add_argument("--timeout", type=float, default=10)
    args = p.parse_args()
    return recv(args) if args.cmd == "recv" else send(args)


if __name__ == "__main__":
    sys.exit(main())
