"""Node checks (doctor) and the Gloo ping matrix (netcheck) on real sockets and processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

from nanochat_cpu import doctor
from nanochat_cpu.perf import cpu_has_native_bf16
from tests.trainer_runs import REPO, free_port, node_env


def test_interface_checks_name_host_interface_and_fix():
    assert doctor.interface_ipv4("lo") == "127.0.0.1"
    assert doctor.check_interface("lo", "127.0.0.0/8") == []
    [missing] = doctor.check_interface("wlp3s0-nope", "127.0.0.0/8")
    assert socket.gethostname() in missing and "'wlp3s0-nope'" in missing and "does not exist" in missing
    assert "lo" in missing and "train_interface" in missing
    [outside] = doctor.check_interface("lo", "192.168.1.0/24")
    assert "127.0.0.1, outside lan_subnet 192.168.1.0/24" in outside
    [unset] = doctor.check_interface("", None)
    assert "GLOO_SOCKET_IFNAME is not set" in unset


def test_foreign_port_holder_is_reported_by_pid_and_name():
    port = free_port()
    holder = subprocess.Popen([sys.executable, "-c", f"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {port})); s.listen(); print("listening", flush=True); time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "listening"
        [problem] = doctor.check_port(port, allowed=set())
        assert f"port {port} is held by PID {holder.pid} (python" in problem
        assert doctor.check_port(port, allowed={doctor.listeners(port)[0][1]}) == []
    finally:
        holder.kill()
    time.sleep(0.2)
    assert doctor.check_port(port, allowed=set()) == []


def test_doctor_cli_reports_every_problem_and_exits_nonzero(tiny_data_dir, tiny_tokenizer_dir):
    env = node_env()
    env.pop("OMP_NUM_THREADS")
    proc = subprocess.run([sys.executable, "-m", "nanochat_cpu.doctor", "--json", "--ifname", "eth-missing",
                           "--data-dir", str(tiny_data_dir), "--tokenizer-dir", str(tiny_tokenizer_dir)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    report = json.loads(proc.stdout)
    assert proc.returncode == len(report["problems"]) == 2
    assert any("OMP_NUM_THREADS is unset" in p for p in report["problems"])
    assert any("'eth-missing'" in p for p in report["problems"])
    assert report["facts"]["backend"] == "gloo"
    # --dtype auto on a CPU node follows the CPU's own bf16 support, nothing else
    assert report["facts"]["dtype"] == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert len(report["facts"]["manifest_sha256"]) == 64 and report["facts"]["vocab_size"] == 512


def test_kernels_capped_at_avx2_decide_and_report_as_an_avx2_cpu():
    """ATEN_CPU_CAPABILITY=avx2 rehearses the user's AVX2-only class on an AVX-512 CPU: no bf16 by
    auto, and every figure's CPU line says the kernels were capped."""
    probe = ("from nanochat_cpu.perf import cpu_flags, cpu_has_native_bf16, cpu_model; import json; "
             "print(json.dumps([cpu_model(), cpu_has_native_bf16(), 'avx512f' in cpu_flags()]))")
    runs = {}
    for cap in ("", "avx2"):
        env = {**node_env(), "ATEN_CPU_CAPABILITY": cap} if cap else node_env()
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60,
                             cwd=REPO, check=True).stdout
        runs[cap] = json.loads(out)
    (model, native, avx512), (capped_model, capped_native, _) = runs[""], runs["avx2"]
    assert capped_native is False and "capped" not in model
    if avx512:
        assert capped_model == f"{model}, torch's kernels capped at AVX2 (ATEN_CPU_CAPABILITY)"
    else:  # an AVX2 CPU runs AVX2 kernels already: nothing to say, nothing changes
        assert capped_model == model and native is False


def netcheck_node(rank: int, nnodes: int, port: int, *extra: str) -> subprocess.Popen:
    """One node's netcheck, with the env the training unit's env file gives it."""
    env = node_env()
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": str(rank),
                "NNODES": str(nnodes)})
    return subprocess.Popen([sys.executable, "-m", "nanochat_cpu.netcheck", *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)


def test_netcheck_ping_matrix_on_three_nodes():
    port = free_port()
    nodes = [netcheck_node(r, 3, port, "--size-mb", "1", "--json") for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0, 0], outs
    assert "netcheck OK: 3 ranks joined" in outs[0]
    rows = json.loads(outs[0].split("NETCHECK_JSON ", 1)[1].splitlines()[0])
    assert [r["rank"] for r in rows] == [0, 1, 2]
    assert all(r["address"] == "127.0.0.1" and r["bus_mb_per_s"] > 0 for r in rows)


def test_netcheck_names_the_rank_that_never_arrives():
    """Node 1 of 2 never starts: node 0 must give up within its timeout, saying so."""
    t0 = time.monotonic()
    node = netcheck_node(0, 2, free_port(), "--timeout", "8")
    out = node.communicate(timeout=120)[0]
    assert node.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "netcheck FAILED on" in out and "GLOO_SOCKET_IFNAME=lo" in out
    assert "could not join the group at 127.0.0.1:" in out and "1/2 clients joined" in out
