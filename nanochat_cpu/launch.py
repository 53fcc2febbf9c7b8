"""`python -m nanochat_cpu.launch <torchrun flags> -m nanochat_cpu.train ...`: torchrun that keeps the exit code.

torchrun exits 1 whatever its workers' exit codes were, so systemd could not tell "bad input,
restarting will not help" (2) or "ranks disagree" (3) from "a peer died" (4). This is torchrun
itself (same flags, same elastic agent, same signal handling) with one change: when every failed
local worker exited with the same code, the launcher exits with that code. The unit then lists
2 and 3 in RestartPreventExitStatus= and restarts only the failures a restart can fix.
A stop signal (systemctl stop) exits 128 + the signal number, like a shell; the workers then stop
at a checkpoint and exit 5 (EXIT_STOPPED), which is also what the launchers of the other nodes
exit with.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .dist import EXIT_STOPPED

EXIT_LAUNCHER = 1  # mixed worker codes, or torchrun itself failed (rendezvous timeout, bad flags)


def exit_code_of(failure: ChildFailedError) -> int:
    codes = {f.exitcode for f in failure.failures.values()}
    if len(codes) == 1:
        code = codes.pop()
        # negative = killed by that signal (torch's convention); report it like a shell does
        return 128 - code if code < 0 else code
    return EXIT_LAUNCHER


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except ChildFailedError as failure:
        code = exit_code_of(failure)
        if code == EXIT_STOPPED:  # not a failure: a peer was stopped, and the ranks saved a checkpoint
            print("launcher: the ranks stopped at a checkpoint (SIGTERM on some node)", file=sys.stderr, flush=True)
        else:  # the same summary torchrun prints, then the workers' own code
            print(failure.format_msg(), file=sys.stderr, flush=True)
        return code
    except SignalException as stop:
        print(f"launcher: stopped by {stop.sigval.name}", file=sys.stderr, flush=True)
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
