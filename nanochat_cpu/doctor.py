"""`python -m nanochat_cpu.doctor`: check one node before it joins a run.

Each check prints `ok` or `PROBLEM` with the host, the value and the fix; the exit status is
the number of problems (capped at 100), so the preflight fails naming every one at once.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import json
import os
import socket
import struct
import sys

SIOCGIFADDR = 0x8915


def interface_ipv4(ifname: str) -> str | None:
    """The interface's IPv4 address, or None if it has none (or does not exist)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def interface_exists(ifname: str) -> bool:
    return os.path.exists(f"/sys/class/net/{ifname}")


def interfaces() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []


def listeners(port: int) -> list[tuple[int, str]]:
    """(pid, process name) of every process listening on TCP `port` (IPv4 or IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                        inodes.add(inode)
        except OSError:
            continue
    found = []
    if not inodes:
        return found
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    with open(f"/proc/{pid}/comm") as c:
                        found.append((int(pid), c.read().strip()))
                    break
        except OSError:
            continue
    return found


def check_interface(ifname: str, lan_subnet: str | None) -> list[str]:
    host = socket.gethostname()
    if not ifname:
        return [f"{host}: GLOO_SOCKET_IFNAME is not set: Gloo would pick an interface itself (docker bridge, "
                f"VPN, IPv6...). Fix: set train_interface for {host} in the inventory"]
    if not interface_exists(ifname):
        return [f"{host}: interface {ifname!r} (GLOO_SOCKET_IFNAME) does not exist; this host has "
                f"{', '.join(interfaces())}. Fix: set train_interface for {host} in the inventory to one of them"]
    addr = interface_ipv4(ifname)
    if addr is None:
        return [f"{host}: interface {ifname} has no IPv4 address (IPv6 only?); Gloo's two ends must use the same "
                f"address family. Fix: give {ifname} an IPv4 address in the LAN or pick another interface"]
    if lan_subnet and ipaddress.ip_address(addr) not in ipaddress.ip_network(lan_subnet, strict=False):
        return [f"{host}: interface {ifname} has {addr}, outside lan_subnet {lan_subnet}. "
                f"Fix: pick the interface on the LAN, or correct lan_subnet"]
    return []


def check_port(port: int, allowed: set[str]) -> list[str]:
    holders = [(pid, name) for pid, name in listeners(port) if name not in allowed]
    if not holders:
        return []
    who = ", ".join(f"PID {pid} ({name})" for pid, name in holders)
    return [f"{socket.gethostname()}: port {port} is held by {who}. Fix: stop it (a stale run? "
            f"`ansible-playbook stop.yml`, or `kill {holders[0][0]}`) or choose another master_port"]


def check_inputs(data_dir: str | None, tokenizer_dir: str | None) -> tuple[list[str], dict]:
    from .data import verify
    from .tokenizer import Tokenizer

    problems, facts = [], {}
    host = socket.gethostname()
    if data_dir:
        try:
            bad = verify(data_dir)
        except Exception as exc:  # noqa: BLE001 - any unreadable manifest is a finding
            bad = [f"{data_dir}: {exc}"]
        problems += [f"{host}: data {b} (fix: re-run site.yml to re-push the dataset)" for b in bad]
        from .data import manifest_hash
        if not bad:
            facts["manifest_sha256"] = manifest_hash(data_dir)
    if tokenizer_dir:
        try:
            tok = Tokenizer.load(tokenizer_dir)
            facts["tokenizer_sha256"] = tok.content_hash()
            facts["vocab_size"] = tok.vocab_size
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{host}: tokenizer in {tokenizer_dir} cannot be loaded: {exc}")
    return problems, facts


def check_run(train_flags: str, world_size: int, first_rank: int) -> list[str]:
    """The trainer's own checks of this node's part of a run, without joining it or writing anything.

    `train_flags` are the unit's TRAIN_ARGS: flag types and ranges, batch arithmetic for
    `world_size`, this host's paths, every shard (parquet footer, rows, a row group per rank),
    the tokenizer, and whether the node's newest checkpoint (of rank `first_rank`) can be
    resumed with this tokenizer and model shape. train.yml's preflight runs it as the unit's
    user, so a bad value stops the run before any unit starts, with nothing changed on the node.
    """
    import contextlib
    import io
    import shlex

    from .config import ConfigError, host_problems, parse_config, validate

    host = socket.gethostname()
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            cfg = parse_config(shlex.split(train_flags))
    except SystemExit:  # argparse's own line names the flag and the value
        reason = (usage.getvalue().strip().splitlines() or ["unparsable"])[-1].split(": error: ", 1)[-1]
        return [f"{host}: the trainer rejects its flags: {reason}. Fix: correct train_extra_args or the extra-var"]
    try:
        validate(cfg, world_size)
    except ConfigError as exc:
        return [f"{host}: {exc}"]
    problems = host_problems(cfg, create=False)
    if not problems:
        problems = run_input_problems(cfg, world_size, first_rank)
    return [f"{host}: {p}" for p in problems]


def run_input_problems(cfg, world_size: int, first_rank: int) -> list[str]:
    import torch

    from . import checkpoint, checkpoint_files
    from .data import check_dataset, manifest_hash, sha256_file
    from .model import GPT, model_config_from
    from .run_state import RunState
    from .tokenizer import Tokenizer

    problems = [f"--data-dir={cfg.data_dir}: {p}" for p in check_dataset(cfg.data_dir, world_size)]
    try:
        tok = Tokenizer.load(cfg.tokenizer_dir)
    except Exception as exc:  # noqa: BLE001 - any load failure is the user's to fix
        return problems + [f"--tokenizer-dir={cfg.tokenizer_dir}: cannot load tokenizer.json: {exc}"]
    steps = checkpoint_files.complete_steps(cfg.out_dir)
    if steps and cfg.resume == "never":  # the trainer would refuse it too: a fresh run would mix with them
        return problems + [f"--resume never, but {cfg.out_dir} holds this run's checkpoints (steps {steps}). Fix: "
                           f"a new run_name for a new run, or resume auto to go on with this one"]
    if cfg.run_id:  # another run's checkpoints are set aside by the trainer, not judged (run_identity.py)
        steps = [s for s in steps if checkpoint_files.marker_run_id(cfg.out_dir, s) in (None, cfg.run_id)]
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(model_config_from(cfg.depth, cfg.aspect_ratio, cfg.head_dim, tok.vocab_size, cfg.max_seq_len,
                                      cfg.window_pattern))
    space = disk_space_problem(cfg, model, steps)
    if space:
        problems.append(space)
    if not steps:
        return problems
    where = checkpoint_files.step_dir(cfg.out_dir, steps[-1])
    sha = sha256_file(os.path.join(cfg.tokenizer_dir, "tokenizer.json"))
    try:
        data_sha = manifest_hash(cfg.data_dir)
    except OSError:  # check_dataset named it
        data_sha = None
    if data_sha is not None:
        terms = checkpoint.ResumeTerms(cfg.tokenizer_dir, sha, tok.vocab_size, cfg.depth, cfg.packing, cfg.data_dir,
                                       data_sha, cfg.data_changed)
        refusal = checkpoint.data_refusal(where, checkpoint_files.read_marker(cfg.out_dir, steps[-1]) or {}, terms)
        if refusal:
            return problems + [refusal]
    try:  # mmap: only the few small entries read are paged in
        # a checkpoint holds every rank of the world that wrote it (an older one only its node's)
        mine = os.path.join(where, f"rank{first_rank}.pt")
        saved = torch.load(mine if os.path.exists(mine) else os.path.join(where, "rank0.pt"), mmap=True,
                           weights_only=True)
        state = torch.load(os.path.join(where, "model.pt"), mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001
        return problems + [f"checkpoint {where} is unreadable ({type(exc).__name__}: {exc}); delete it to resume "
                           f"from the one before"]
    refusal = checkpoint.tokenizer_refusal(cfg.tokenizer_dir, where, RunState.of_rank_file(saved), sha,
                                           tok.vocab_size)
    if refusal:
        return problems + [refusal]
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    if want != have:
        differ = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
        problems.append(f"checkpoint {where} does not fit this model (--depth {cfg.depth}, vocab {tok.vocab_size}): "
                        f"{len(differ)} tensors differ, e.g. {differ[0]} {have.get(differ[0])} vs "
                        f"{want.get(differ[0])}. Fix: the run's original settings, or a new run_name")
    return problems


# A checkpoint of a run that has none yet, as a multiple of its weights' bytes: the weights, and
# every rank's optimizer state beside them (a momentum for every matrix, two moments for the
# embeddings and the head), measured at 2.5x on a synchronous 2-rank run. Kept low: an estimate
# that refused a disk with room would be worse than the first checkpoint's own full-disk stop.
CHECKPOINT_PER_WEIGHT_BYTE = 2.0


def disk_space_problem(cfg, model, steps: list[int]) -> str | None:
    """Whether the disk under --out-dir has room for the run's checkpoints: --keep-checkpoints of
    them and the one being written, each the size of the newest this node holds (else estimated
    from the model), less what the run's own checkpoints hold already."""
    import contextlib
    import shutil

    from . import checkpoint_files
    from .config import nearest_existing_dir

    def step_bytes(step: int) -> int:
        """0 for a step pruned meanwhile (with restart=true the old run trains on through the preflight)."""
        d, total = checkpoint_files.step_dir(cfg.out_dir, step), 0
        with contextlib.suppress(OSError):
            for entry in os.scandir(d):
                with contextlib.suppress(OSError):
                    total += entry.stat().st_size
        return total

    sizes = {s: step_bytes(s) for s in steps}
    held = sum(sizes.values())
    if any(sizes.values()):
        newest = max(s for s, size in sizes.items() if size)
        size, how = sizes[newest], f"the size of its step {newest}"
    else:
        weights = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        per_weight = CHECKPOINT_PER_WEIGHT_BYTE
        if cfg.outer_compress != "none" and cfg.sync_every != "1":  # each node's first rank: an fp32 residual
            per_weight += 2  # of the whole model; two nodes at least (kept low, as above)
        size, how = int(weights * per_weight), "estimated from the model's weights"
    need = (cfg.keep_checkpoints + 1) * size - held
    free = shutil.disk_usage(nearest_existing_dir(cfg.out_dir)).free
    if free >= need:
        return None
    return (f"--out-dir={cfg.out_dir}: {free / 2**20:,.0f} MiB free on its disk, but the run's checkpoints need "
            f"{need / 2**20:,.0f} MiB more ({cfg.keep_checkpoints} kept + 1 being written, {size / 2**20:,.1f} MiB "
            f"each: {how}). Fix: free space on that disk, point the runs directory at a larger one, or keep fewer "
            f"(-e train_extra_args='--keep-checkpoints 2', at least 2)")


def check_device(device: str, nproc_per_node: int = 1) -> tuple[list[str], dict]:
    import torch

    from .core_types import hybrid_cpu, layouts
    from .perf import cpu_has_native_bf16, physical_cores
    from .precision import compute_dtype

    host = socket.gethostname()
    native_bf16 = cpu_has_native_bf16()
    # what --dtype auto picks on this node alone; a run takes fp32 if any rank's CPU lacks bf16
    dtype, _ = compute_dtype("auto", device, [] if native_bf16 else [host])
    facts = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
             "threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
             "physical_cores": physical_cores(), "cpu_native_bf16": native_bf16,
             "backend": {"cpu": "gloo", "cuda": "nccl"}[device],
             "dtype": str(dtype).removeprefix("torch.")}
    allowed = os.sched_getaffinity(0)
    cpu = hybrid_cpu(allowed)
    # what --hybrid-threads auto will time at the run's start on this node's first rank (core_types.py);
    # None: not a hybrid CPU
    facts["hybrid_cpu"] = cpu and (f"{cpu.said()}; a run's first rank here times " + " against ".join(
        o.said() for o in layouts(cpu, allowed, torch.get_num_threads(), 0, nproc_per_node)) + " and keeps the faster")
    problems = []
    if device == "cuda" and not torch.cuda.is_available():
        problems.append(f"{host}: --device cuda but torch {torch.__version__} sees no GPU. Fix: torch_variant "
                        f"cu12x in the inventory, or train_device: cpu")
    if not os.environ.get("OMP_NUM_THREADS"):
        problems.append(f"{host}: OMP_NUM_THREADS is unset (torchrun would force 1 thread). Fix: set "
                        f"omp_num_threads for {host}; physical cores here: {facts['physical_cores']}")
    return problems, facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanochat_cpu.doctor", allow_abbrev=False)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ifname", default=os.environ.get("GLOO_SOCKET_IFNAME", ""))
    p.add_argument("--lan-subnet", default=None)
    p.add_argument("--master-port", type=int, default=None, help="check that no foreign process holds it")
    p.add_argument("--allow-holder", action="append", default=[],
                   help="process names allowed to hold the port (our own running unit)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--tokenizer-dir", default=None)
    p.add_argument("--train-flags", default=None,
                   help="the run's trainer flags (the unit's TRAIN_ARGS): check them and their inputs here")
    p.add_argument("--world-size", type=int, default=1, help="ranks in the run (for --train-flags)")
    p.add_argument("--first-rank", type=int, default=0, help="this node's first rank (for --train-flags)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="this node's ranks (the P-cores they share)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    problems, facts = check_device(args.device, args.nproc_per_node)
    problems += check_interface(args.ifname, args.lan_subnet)
    facts["ifname"], facts["ipv4"] = args.ifname, interface_ipv4(args.ifname) if args.ifname else None
    if args.master_port:
        problems += check_port(args.master_port, set(args.allow_holder))
    more, data_facts = check_inputs(args.data_dir, args.tokenizer_dir)
    problems += more
    facts.update(data_facts)
    if args.train_flags is not None:
        problems += check_run(args.train_flags, args.world_size, args.first_rank)
    facts["host"] = socket.gethostname()
    if args.json:
        print(json.dumps({"facts": facts, "problems": problems}))
    else:
        for k, v in facts.items():
            print(f"  {k}: {v}")
        for prob in problems:
            print(f"PROBLEM {prob}")
        print("doctor: ok" if not problems else f"doctor: {len(problems)} problem(s)")
    return min(len(problems), 100)


if __name__ == "__main__":
    sys.exit(main())
