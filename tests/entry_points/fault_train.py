"""The trainer with one checkpoint write sabotaged, for the fault tests (tests/test_faults_trainer.py).

    FAULT_RANK=0 FAULT_STEP=8 FAULT_FILE=model.pt FAULT_MODE=kill python tests/entry_points/fault_train.py [train flags]

When rank FAULT_RANK writes FAULT_FILE of checkpoint step FAULT_STEP (model.pt through
atomic_torch_save, a rank's file through atomic_write_bytes):
  kill    half of the file's bytes reach its temporary file, then the process SIGKILLs itself:
          a crash or power loss in the middle of a checkpoint, at a known point;
  enospc  the real write path runs and the disk "fills up" half way (OSError ENOSPC);
  hang    half of the bytes, then the write never returns, as on a dying disk or a hung mount.
Everything else is the real trainer.
"""

import errno
import io
import os
import signal
import time

import torch

from nanochat_cpu import checkpoint_files

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


checkpoint_files.atomic_torch_save = sabotaged_save
checkpoint_files.atomic_write_bytes = sabotaged_write_bytes

from nanochat_cpu.train import main  # noqa: E402 - the patch must precede the import

main()
