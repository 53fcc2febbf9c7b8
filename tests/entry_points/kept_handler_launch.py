"""The launcher (`nanochat_cpu.launch.main`, same arguments) with every rendezvous handler torch
makes kept alive past the agent's end, as a reference cycle or a stored traceback can keep one.
When main returns it prints `threads left: <names>` (the threads still running besides this one)
and exits with main's code."""

import sys
import threading

import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

from nanochat_cpu.launch import main

kept = []
make_handler = dynamic_rendezvous.DynamicRendezvousHandler.__init__


def keep_handler(self, *args, **kwargs):
    make_handler(self, *args, **kwargs)
    kept.append(self)


dynamic_rendezvous.DynamicRendezvousHandler.__init__ = keep_handler

if __name__ == "__main__":
    code = main(sys.argv[1:])
    left = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
    print(f"threads left: {left} ({len(kept)} handler(s) kept)", flush=True)
    sys.exit(code)
