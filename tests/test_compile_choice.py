"""--compile auto follows the measurement: forced step timings give compiled or eager; and a compiled
model trains the same model as eager, within the tolerance docs/TRAINER.md states."""

from __future__ import annotations

import pytest
import torch

from nanochat_cpu import compile_choice
from nanochat_cpu.compile_choice import COLD_COMPILE_S, PAYBACK, TIMED_STEPS, CompileChoice
from nanochat_cpu.model import GPT, model_config_from

# A compiled model's loss and gradients against eager's, fp32: relative, on the loss and on the
# largest gradient entry (the compiler fuses and reorders the same arithmetic)
COMPILED_TOLERANCE = 1e-4


def drive(choice: CompileChoice, eager_s: float, compiled_s: float, run=lambda compiled: None) -> list[str]:
    """Steps timed as given until auto decides: step 1, the eager steps, the trial compile between
    two steps (`run` stands in for its forward and backward), the compiled steps. Returns the lines
    it logged and checks the model it hands out at each step."""
    lines, step = [], 0
    while choice.decided is None:
        if choice.wants_trial:
            lines.append(choice.trial(step, run))
            continue
        step += 1
        model = choice.model_for_step()
        if model is choice.model:
            t = eager_s * (3 if step == 1 else 1)  # step 1 allocates: slow, and left out
        else:
            t = compiled_s * (5 if choice.compiled == [] and choice._seen_compiled == 0 else 1)
        line = choice.record(step, t)
        if line:
            lines.append(line)
        assert step < 20, "auto never decided"
    return lines


def long_run(eager_s: float) -> int:
    return int(3 * PAYBACK * COLD_COMPILE_S / eager_s)


@pytest.mark.parametrize(("compiled_s", "want"), [(0.8, True), (0.99, False), (1.2, False)])
def test_auto_takes_the_faster_of_the_measured_steps(compiled_s, want):
    model = torch.nn.Linear(2, 2)
    choice = CompileChoice(model, "auto", "measured", long_run(1.0))
    ran = []
    lines = drive(choice, eager_s=1.0, compiled_s=compiled_s, run=ran.append)
    assert len(ran) == 1 and ran[0] is not model  # one trial compile, of a compiled wrapper of the model
    assert choice.decided is want
    assert choice.eager == [1.0] * TIMED_STEPS and choice.compiled == [compiled_s] * TIMED_STEPS
    assert "compile auto: eager 1.00 s/step over steps 2-4; compiled in 0 s" in lines[0]
    assert f"compile {'on' if want else 'off'} (auto: measured on this run: eager 1.00 s/step, compiled " \
           f"{compiled_s:.2f} s/step (compile took 0 s)" in lines[1]
    assert (choice.model_for_step() is not model) is want  # the rest of the run runs what was chosen
    assert choice.state_dict() == {"compiled": want, "why": choice.why}


def test_a_run_too_short_to_pay_for_a_compile_stays_eager_without_compiling():
    model = torch.nn.Linear(2, 2)
    steps = int(PAYBACK * COLD_COMPILE_S / 1.0) // 2  # half the length a compile needs
    choice = CompileChoice(model, "auto", "measured", steps)
    ran = []
    lines = drive(choice, eager_s=1.0, compiled_s=0.1, run=ran.append)
    assert choice.decided is False and choice.compiled == [] and choice.compile_s is None and ran == []
    assert len(lines) == 1 and "compile off (auto: eager 1.00 s/step; the" in lines[0] and "not tried" in lines[0]


def test_a_compile_that_fails_leaves_the_run_eager_and_says_why():
    model = torch.nn.Linear(2, 2)
    choice = CompileChoice(model, "auto", "measured", long_run(1.0))

    def broken(compiled):
        raise RuntimeError("fatal error: Python.h: No such file or directory\ncompilation terminated.")

    lines = drive(choice, eager_s=1.0, compiled_s=0.1, run=broken)
    assert choice.decided is False and choice.model_for_step() is model
    assert lines == ["compile off (auto: eager 1.00 s/step; not compiled: compiling failed (RuntimeError: "
                     "fatal error: Python.h: No such file or directory))"]


def test_a_host_without_memory_for_the_compiled_model_is_not_tried(monkeypatch):
    monkeypatch.setattr(compile_choice, "available_memory_mib", lambda: 100.0)
    monkeypatch.setattr(compile_choice, "peak_rss_mib", lambda: 6000.0)
    choice = CompileChoice(torch.nn.Linear(2, 2), "auto", "measured", long_run(1.0), ranks_on_host=2)
    ran = []
    lines = drive(choice, eager_s=1.0, compiled_s=0.1, run=ran.append)
    assert choice.decided is False and ran == []
    assert "needs ~2.2x the memory of eager: ~14.1 GiB more on this host, 0.1 GiB free" in lines[0]


def test_on_and_off_decide_at_once_and_a_resumed_run_keeps_its_choice():
    model = torch.nn.Linear(2, 2)
    assert CompileChoice(model, "on", "requested", 10).model_for_step() is not model
    off = CompileChoice(model, "off", "requested", 10)
    assert off.model_for_step() is model and off.record(2, 1.0) is None and off.state_dict() is None
    resumed = CompileChoice(model, "auto", "measured", 10)
    line = resumed.resume({"compiled": True, "why": "auto: measured on this run: eager 1.00 s/step"})
    assert resumed.decided is True and resumed.model_for_step() is not model
    assert "compile on (auto: measured on this run" in line and "kept on resume" in line


def test_the_margin_is_what_separates_a_measured_gain_from_noise(monkeypatch):
    monkeypatch.setattr(compile_choice, "MARGIN", 0.0)
    assert compile_choice.compiled_pays(1.0, 0.99)
    monkeypatch.undo()
    assert not compile_choice.compiled_pays(1.0, 0.99) and compile_choice.compiled_pays(1.0, 0.97)


def test_a_compiled_model_trains_the_eager_model_within_the_tolerance():
    """One forward and backward of a small GPT, compiled (the dense embedding gradient, the plain
    loss the compiler fuses) against eager (sparse rows, loss.py's fused loss)."""
    torch.manual_seed(0)
    model = GPT(model_config_from(depth=2, aspect_ratio=32, head_dim=32, vocab_size=300, seq_len=32,
                                  window_pattern="SL"))
    model.init_weights(0)
    x = torch.randint(0, 300, (2, 32))
    y = torch.randint(0, 300, (2, 32))
    for p in model.parameters():  # nonzero output projections, so every parameter gets a gradient
        p.data.add_(0.01 * torch.randn_like(p))
    losses, grads = [], []
    for fwd in (model, torch.compile(model, dynamic=False)):
        model.zero_grad(set_to_none=True)
        loss = fwd(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.to_dense() for n, p in model.named_parameters()})
    assert losses[1] == pytest.approx(losses[0], rel=COMPILED_TOLERANCE)
    for name, eager in grads[0].items():
        assert (grads[1][name] - eager).abs().max() <= COMPILED_TOLERANCE * eager.abs().max(), name
