"""`--compile auto`: compiled or eager, decided by timing both on the run's own shapes and machine.

Whether torch.compile pays off on a CPU depends on the shapes (tokens a step, width, vocabulary)
and on the CPU itself: on a 2-core Xeon with AMX it was slower than our eager model at 1,024
tokens a step, and a cold compile costs a minute or more, which is everything to a 20-step demo
and nothing to a four-day run. So auto decides from measurements, taken from the run's own steps
(every one of them trains; nothing is thrown away):

1. eager steps 2 .. 1 + TIMED_STEPS are timed (step 1 pays for first-touch allocations);
2. if what is left of the run, at the eager speed, is under PAYBACK x the compile's cost, the run
   stays eager: a compile could not pay for itself; so it does where the host's free memory could
   not hold the compiled model's activations (COMPILED_RSS_FACTOR x the peak so far: measured
   2.15x at depth 6 and 16,384 tokens a step, where the compiler keeps more than our eager model);
3. otherwise, between two steps, the compiled model runs a forward and backward of random tokens
   (`trial`: the compile, timed, with nothing trained and nothing sent; its gradients are
   dropped). A compile that fails (no Python headers, a sandbox) leaves the run eager, with the
   error in the journal, instead of failing a step;
4. the TIMED_STEPS steps after the first compiled one are timed, and the faster wins for the rest
   of the run, compiled only if faster by more than MARGIN. The ranks that step together decide
   together (the slowest rank's times count, any rank's failure stops the trial), so every rank of
   an optimizer runs the same kind of model.

The compile's cost estimate is COLD_COMPILE_S before one has run; the choice is kept in the
checkpoint, so a resumed run takes it again at once (and its compile cache, which the unit keeps
with the run, makes the recompile short).

Whole steps are timed, less their waits on other ranks: the optimizer is never compiled, but a
compiled model's gradients (dense embedding tables, copied into the optimizer's buffers) change its
work too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .config import cxx_compiler, cxx_name
from .perf import available_memory_mib, peak_rss_mib

TIMED_STEPS = 3
# A cold compile of the model on a 2-core CPU: 30-70 s measured at depth 4-8 (docs/TRAINER.md, "Compiled or eager"),
# taken high so that a run too short to gain is not made to compile
COLD_COMPILE_S = 90.0
PAYBACK = 10  # compile only where the rest of the run is at least 10 compiles long
MARGIN = 0.02  # compiled must be 2% faster: within that the timings cannot tell them apart
COMPILED_RSS_FACTOR = 2.2  # compiled peak RSS / eager, measured 2.15 at depth 6, 16,384 tokens a step


def resolve_compile(requested: str, device: str) -> tuple[str, str]:
    """--compile's mode for CompileChoice ("on", "off", or "auto": measured on the run) and why."""
    if requested != "auto":
        return requested, f"requested --compile {requested}"
    if device == "cuda":
        return "on", "auto: compile pays off on CUDA"
    if not cxx_compiler():
        return "off", (f"auto: no C++ compiler ({cxx_name()}) on this host for "
                       f"torch.compile's CPU code; install g++ to let auto measure it")
    return "auto", (f"auto: eager steps 2-{1 + TIMED_STEPS} are timed, then compiled ones if the run is long "
                    f"enough to pay for a compile; the faster runs the rest")


def compiled_pays(eager_s: float, compiled_s: float) -> bool:
    """The decision itself: is the compiled step faster by more than the margin?"""
    return compiled_s < eager_s * (1 - MARGIN)


def worth_trying(eager_s: float, steps_left: int) -> bool:
    """Could a compile (COLD_COMPILE_S) pay for itself in what is left of the run?"""
    return steps_left * eager_s >= PAYBACK * COLD_COMPILE_S


@dataclass
class CompileChoice:
    """The state of --compile's decision: the model to run each step, and what was measured."""

    model: torch.nn.Module
    mode: str  # "on", "off" or "auto"
    why: str  # the mode's reason, for the banner; then the decision's
    num_iterations: int
    group: dist.ProcessGroup | None = None  # the ranks that step together; None: every rank
    distributed: bool = False  # more than one rank steps together: they agree on the timings
    ranks_on_host: int = 1  # their memory comes out of one host's
    decided: bool | None = None  # None while auto measures; then compiled or not
    eager: list[float] = field(default_factory=list)
    compiled: list[float] = field(default_factory=list)
    compile_s: float | None = None
    wants_trial: bool = False  # the eager steps say try: `trial` before the next step
    _compiled_model: torch.nn.Module | None = None
    _seen_eager = 0
    _seen_compiled = 0

    def __post_init__(self) -> None:
        if self.mode != "auto":
            self.decided = self.mode == "on"

    def resume(self, saved: dict | None) -> str | None:
        """A choice an earlier part of this run made (from its checkpoint), taken again at once;
        returns the line to log."""
        if self.mode != "auto" or saved is None:
            return None
        self.decided, self.why = bool(saved["compiled"]), saved["why"]
        return f"compile {'on' if self.decided else 'off'} ({self.why}; chosen earlier in this run, kept on resume)"

    def state_dict(self) -> dict | None:
        return None if self.mode != "auto" or self.decided is None else {"compiled": self.decided, "why": self.why}

    @property
    def compiling(self) -> bool:
        """Whether the model in use is (or is being) compiled."""
        return self.decided is True or (self.decided is None and self.compile_s is not None)

    def model_for_step(self) -> torch.nn.Module:
        if self.compiling:
            if self._compiled_model is None:
                self._compiled_model = torch.compile(self.model, dynamic=False)
            return self._compiled_model
        return self.model

    def restart_timing(self) -> None:
        """The steps' shape changed (a new work split): auto's eager timings so far no longer apply."""
        if self.decided is None and not self.compiling:
            self.eager.clear()

    def record(self, step: int, compute_s: float) -> str | None:
        """Step `step`'s seconds, less its waits on other ranks (steps count from 1); returns a line
        to log when a decision is made."""
        if self.decided is not None:
            return None
        if not self.compiling:
            self._seen_eager += 1
            if self._seen_eager > 1:  # the first step allocates; it is not the eager speed
                self.eager.append(compute_s)
            if len(self.eager) < TIMED_STEPS:
                return None
            eager_s = self._agreed(self.eager)
            self.eager = [eager_s] * TIMED_STEPS
            if not worth_trying(eager_s, self.num_iterations - step):
                return self._decide(False, f"eager {eager_s:.2f} s/step; the {self.num_iterations - step} steps "
                                           f"left take {(self.num_iterations - step) * eager_s / 60:.1f} min, "
                                           f"under {PAYBACK}x a compile (~{COLD_COMPILE_S:.0f} s): not tried")
            self.wants_trial = True
            return None
        self._seen_compiled += 1
        if self._seen_compiled == 1:  # the first compiled step may still specialise: not timed
            return None
        self.compiled.append(compute_s)
        if len(self.compiled) < TIMED_STEPS:
            return None
        eager_s, compiled_s = self.eager[0], self._agreed(self.compiled)
        verdict = compiled_pays(eager_s, compiled_s)
        return self._decide(verdict, f"measured on this run: eager {eager_s:.2f} s/step, compiled {compiled_s:.2f} "
                                     f"s/step (compile took {self.compile_s:.0f} s): "
                                     f"{'compiled' if verdict else 'eager'} for the rest")

    def trial(self, step: int, run: Callable[[torch.nn.Module], None]) -> str:
        """Compile between steps: `run(compiled_model)` does a forward and backward whose gradients
        the caller drops. Returns the line to log; the run stays eager if any rank cannot."""
        self.wants_trial = False
        eager_s = self.eager[0]
        need = (COMPILED_RSS_FACTOR - 1) * peak_rss_mib() * self.ranks_on_host
        free = available_memory_mib()
        problem = ""
        if free is not None and free < need:
            problem = (f"a compiled model needs ~{COMPILED_RSS_FACTOR}x the memory of eager: ~{need / 1024:.1f} GiB "
                       f"more on this host, {free / 1024:.1f} GiB free")
        else:
            compiled = torch.compile(self.model, dynamic=False)
            t0 = time.perf_counter()
            try:
                run(compiled)
                self._compiled_model, self.compile_s = compiled, time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: stay eager, say why
                problem = f"compiling failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]})"
        failed = self._agreed([1.0 if problem else 0.0])  # a failure anywhere stops every rank's trial
        if failed:
            self.compile_s = None
            return self._decide(False, f"eager {eager_s:.2f} s/step; not compiled: "
                                       f"{problem or 'another rank could not compile'}")
        return (f"compile auto: eager {eager_s:.2f} s/step over steps {step - TIMED_STEPS + 1}-{step}; compiled in "
                f"{self.compile_s:.0f} s, now timing compiled steps against it")

    def _agreed(self, times: list[float]) -> float:
        """The mean of this rank's times, the slowest rank's where ranks step together."""
        mean = torch.tensor(sum(times) / len(times), dtype=torch.float64)
        if self.distributed:
            dist.all_reduce(mean, op=dist.ReduceOp.MAX, group=self.group)
        return float(mean)

    def _decide(self, compiled: bool, why: str) -> str:
        self.decided, self.why = compiled, f"auto: {why}"
        if not compiled:
            self._compiled_model = None
        return f"compile {'on' if compiled else 'off'} ({self.why})"
