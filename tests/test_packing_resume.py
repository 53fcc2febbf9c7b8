"""A checkpoint's loader position belongs to its packing: resumed with the other one, every rank
stops before step 1 naming the flag to resume with; with its own it goes on."""

from __future__ import annotations

import re

from tests.trainer_runs import losses, run_torchrun, tiny_flags, train_target


def test_a_checkpoint_resumed_with_the_other_packing_is_refused_naming_the_flag(tiny_data_dir, tiny_tokenizer_dir,
                                                                                 tmp_path):
    def run(**over):
        flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, tmp_path / "run", checkpoint_every=4, **over)
        proc = run_torchrun(1, train_target(*flags), timeout=180)
        return proc.returncode, proc.stdout + proc.stderr

    code, out = run(num_iterations=4)
    assert code == 0 and "documents packed best fit, each row from a document's start (--packing bestfit)" in out, out
    code, out = run(num_iterations=8, packing="stream")
    assert code != 0, out
    # the checkpoint's check, every rank before step 1: not the loader's error at its construction
    assert re.search(r"checkpoint \S+step_000004: the loader's position was saved with --packing bestfit, this run "
                     r"packs with --packing stream: resume with --packing bestfit \(train.yml: -e packing=bestfit\)",
                     out), out
    assert "Traceback" not in out, out
    assert not losses(out), "no step may run on a position the loader cannot continue"
    code, out = run(num_iterations=8)
    assert code == 0 and sorted(losses(out)) == [5, 6, 7, 8], out
