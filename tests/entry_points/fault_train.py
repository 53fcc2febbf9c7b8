"""The trainer with one checkpoint write sabotaged, for the fault tests (tests/test_faults_trainer.py).

    FAULT_RANK=0 FAULT_STEP=8 FAULT_FILE=model.pt FAULT_MODE=kill python tests/entry_points/fault_train.py [train flags]

When rank FAULT_RANK writes FAULT_FILE of checkpoint step FAULT_STEP (model.pt through
atomic_torch_save, a rank's file or the seal, COMPLETE, through atomic_write_bytes):
  kill    half of the file's bytes reach its temporary file, then the process SIGKILLs itself:
          a crash or power loss in the middle of a checkpoint, at a known point;
  enospc  the real write path runs and the disk "fills up" half way (OSError ENOSPC);
  hang    half of the bytes, then the write never returns, as on a dying disk or a hung mount.

Three more points, with FAULT_MODE=kill, where a checkpoint waits on the wire rather than a disk
(the bytes then cross in rounds of 8 KiB on every rank, so that each has several):
  FAULT_FILE=transfer  rank FAULT_RANK dies in the second round of step FAULT_STEP's states
                       crossing to every disk (checkpoint_transfer.exchange_bytes);
  FAULT_FILE=restore   rank FAULT_RANK dies in the second round of a file it sends, at the start,
                       to a disk that lacks the checkpoint (checkpoint.restore_missing);
  FAULT_FILE=check     rank FAULT_RANK dies while it reads model.pt of the checkpoint the run
                       resumes, to check its sha256 (checkpoint.check_bytes), the others waiting.
Everything else is the real trainer.
"""

import errno
import io
import os
import signal
import time

import torch

from nanochat_cpu import checkpoint, checkpoint_files, checkpoint_transfer

_real_save = checkpoint_files.atomic_torch_save
_target = (os.environ["FAULT_RANK"], f"step_{int(os.environ['FAULT_STEP']):06d}", os.environ["FAULT_FILE"])
_mode = os.environ["FAULT_MODE"]


def _half_then(obj, f, then) -> None:
    buf = io.BytesIO()
    _real_torch_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])
    f.flush()
    os.fsync(f.fileno())
    then()


def _kill() -> None:
    print(f"FAULT: SIGKILL while writing {_target}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _enospc() -> None:
    print(f"FAULT: ENOSPC while writing {_target}", flush=True)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _hang() -> None:
    print(f"FAULT: the disk stops answering while writing {_target}", flush=True)
    time.sleep(3600)


_then = {"kill": _kill, "enospc": _enospc, "hang": _hang}[_mode]
_real_torch_save = torch.save


def _is_target(path: str) -> bool:
    return (os.environ.get("RANK", "0"), os.path.basename(os.path.dirname(path)), os.path.basename(path)) == _target


def sabotaged_save(obj, path: str, *progress) -> str:
    """model.pt: torch.save's output cut half way."""
    if not _is_target(path):
        return _real_save(obj, path, *progress)
    torch.save = lambda o, f: _half_then(o, f, _then)  # the real atomic_torch_save around it
    try:
        return _real_save(obj, path, *progress)
    finally:
        torch.save = _real_torch_save


class _HalfFile:
    """The real file, whose one write reaches half of its bytes before `then`."""

    def __init__(self, f, then):
        self.f, self.then = f, then

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()

    def write(self, data) -> None:
        self.f.write(bytes(memoryview(data)[: len(data) // 2]))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.then()


_real_write_bytes = checkpoint_files.atomic_write_bytes


def sabotaged_write_bytes(path: str, data, *progress) -> str:
    """rank{r}.pt, written as the bytes the rank sent: the real atomic_write_bytes, its file cut half way."""
    if not _is_target(path):
        return _real_write_bytes(path, data, *progress)
    checkpoint_files.open = lambda name, mode: _HalfFile(open(name, mode), _then)  # shadows the builtin there
    try:
        return _real_write_bytes(path, data, *progress)
    finally:
        del checkpoint_files.open


_real_exchange_bytes = checkpoint_transfer.exchange_bytes
_real_exchange_chunk = checkpoint_transfer.exchange_chunk
_real_send_bytes = checkpoint.send_bytes
_real_bad_files = checkpoint.bad_files
_rounds = {"armed": False, "done": 0}  # the wire's rounds on this rank since the target transfer began


def _is_rank() -> bool:
    return os.environ.get("RANK", "0") == _target[0]


def sabotaged_exchange_bytes(env, disks, data, dst, watchdog, step, what):
    """Step FAULT_STEP's states crossing: armed, so that exchange_chunk kills in its second round."""
    _rounds["armed"] = _is_rank() and f"step_{step:06d}" == _target[1] and what == "checkpoint states"
    return _real_exchange_bytes(env, disks, data, dst, watchdog, step, what)


def sabotaged_exchange_chunk(*args, **kwargs) -> None:
    if _rounds["armed"]:
        _rounds["done"] += 1
        if _rounds["done"] == 2:
            _then()
    _real_exchange_chunk(*args, **kwargs)


def sabotaged_send_bytes(env, disks, data, src, dst, watchdog, what):
    """A restored file leaving its sender: cut in its second round (send_bytes sends its size first)."""
    if env.rank != src or not _is_rank():
        return _real_send_bytes(env, disks, data, src, dst, watchdog, what)
    real_send, sent = checkpoint_transfer.dist.send, []

    def send(*args, **kwargs):
        sent.append(1)
        if len(sent) == 3:  # its size, round 1, then round 2
            _then()
        return real_send(*args, **kwargs)

    checkpoint_transfer.dist.send = send
    try:
        return _real_send_bytes(env, disks, data, src, dst, watchdog, what)
    finally:
        checkpoint_transfer.dist.send = real_send


def sabotaged_bad_files(out_dir, step, marker, *progress):
    if _is_rank() and "model.pt" in marker.get("sha256", {}):
        _then()
    return _real_bad_files(out_dir, step, marker, *progress)


checkpoint_files.atomic_torch_save = sabotaged_save
checkpoint_files.atomic_write_bytes = sabotaged_write_bytes
if _target[2] in ("transfer", "restore", "check"):  # only the point asked for is sabotaged
    checkpoint_transfer.CHUNK_BYTES = 8192
if _target[2] == "transfer":
    checkpoint_transfer.exchange_bytes = sabotaged_exchange_bytes
    checkpoint_transfer.exchange_chunk = sabotaged_exchange_chunk
elif _target[2] == "restore":
    checkpoint.send_bytes = sabotaged_send_bytes
elif _target[2] == "check":
    checkpoint.bad_files = sabotaged_bad_files

from nanochat_cpu.train import main  # noqa: E402 - the patch must precede the import

main()
