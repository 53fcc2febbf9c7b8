"""Gloo ping matrix: `python -m nanochat_cpu.netcheck`, run by the preflight on every node at once.

It reads the same environment as the training unit (MASTER_ADDR, MASTER_PORT, NODE_RANK,
NNODES, GLOO_SOCKET_IFNAME; or RANK/WORLD_SIZE under torchrun) and does its own rendezvous, so
every failure is reported by us, with names, instead of by a launcher.

A network that would hang a training run must fail here, in seconds, with names:
1. join a Gloo group with a short timeout (rendezvous through MASTER_ADDR:MASTER_PORT);
2. `monitored_barrier(wait_all_ranks=True)`: rank 0 names every rank that did not arrive;
3. timed all-reduces of a few MB: every rank reports its host, interface, address and the
   bandwidth it saw; rank 0 prints one table.
Exit 0 when every rank took part, non-zero with the missing ranks otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from .doctor import interface_ipv4


def measure(size_mb: float, rounds: int) -> tuple[float, float]:
    """(seconds per all-reduce, algorithmic bandwidth in MB/s) for a float32 tensor of size_mb."""
    t = torch.ones(int(size_mb * 1e6 / 4))
    dist.all_reduce(t)  # warm up the pairs' connections
    t0 = time.perf_counter()
    for _ in range(rounds):
        dist.all_reduce(t)
    per = (time.perf_counter() - t0) / rounds
    # ring all-reduce moves 2(n-1)/n of the buffer through each rank
    n = dist.get_world_size()
    return per, (2 * (n - 1) / n) * size_mb / per


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanochat_cpu.netcheck", allow_abbrev=False)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds for rendezvous and each collective")
    p.add_argument("--size-mb", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the table as one JSON line too")
    args = p.parse_args(argv)

    host = socket.gethostname()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    addr = interface_ipv4(ifname) if ifname else None
    rank = int(os.environ.get("RANK", os.environ.get("NODE_RANK", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("NNODES", "1")))
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as exc:  # noqa: BLE001 - report any rendezvous failure with names
        print(f"netcheck FAILED on {host} (rank {rank}, GLOO_SOCKET_IFNAME={ifname or 'unset'}, address {addr}): "
              f"could not join the group at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}: "
              f"{exc}", flush=True)
        os._exit(1)
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=args.timeout), wait_all_ranks=True)
        per, mbps = measure(args.size_mb, args.rounds)
    except Exception as exc:  # noqa: BLE001
        print(f"netcheck FAILED on {host} (rank {rank}/{world}, {ifname or 'unset'} {addr}): {exc}", flush=True)
        os._exit(1)
    row = {"rank": rank, "host": host, "ifname": ifname, "address": addr,
           "allreduce_ms": round(per * 1000, 2), "bus_mb_per_s": round(mbps, 1)}
    rows: list[dict | None] = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        print(f"netcheck OK: {world} ranks joined; all-reduce of {args.size_mb} MB:", flush=True)
        for r in rows:
            assert r is not None
            print(f"  rank {r['rank']:>2} {r['host']:<20} {r['ifname'] or '-':<10} {str(r['address']):<15} "
                  f"{r['allreduce_ms']:>8.2f} ms  {r['bus_mb_per_s']:>9.1f} MB/s", flush=True)
        if args.json:
            print("NETCHECK_JSON " + json.dumps(rows), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
