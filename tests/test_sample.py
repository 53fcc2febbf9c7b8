"""Talking to a trained model: `python -m nanochat_cpu.sample` on the checkpoints of a real (tiny)
run of the trainer, and the KV cache against re-reading the whole context."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat_cpu import sample
from nanochat_cpu.model import KVCache, kept_context
from nanochat_cpu.tokenizer import TOKENIZER_FILE, Tokenizer
from tests.trainer_runs import REPO, node_env, tiny_flags

SEQ_LEN = 32  # tiny, so that a few dozen tokens run past the context and its cut


@pytest.fixture(scope="module")
def run_dir(tiny_data_dir, tiny_tokenizer_dir, tmp_path_factory) -> Path:
    """A real single-process run, depth 2, checkpoints at steps 4 and 8 (one per module: ~10 s)."""
    out = tmp_path_factory.mktemp("sample_run")
    flags = tiny_flags(tiny_data_dir, tiny_tokenizer_dir, out, max_seq_len=SEQ_LEN, total_batch_size=2 * SEQ_LEN,
                       num_iterations=8, eval_tokens=2 * SEQ_LEN)
    proc = subprocess.run([sys.executable, "-m", "nanochat_cpu.train", *flags], env=node_env(2), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sample step 00008:" in proc.stdout  # the trainer's own sample went through GPT.generate
    return out


def run_sample(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanochat_cpu.sample", *args], env=node_env(2), cwd=REPO,
                          input=stdin, capture_output=True, text=True, timeout=120)


def sample_in_process(capsys, *args: str) -> tuple[int, str, str]:
    code = sample.main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def loaded(run_dir: Path, *args: str) -> sample.Loaded:
    return sample.load(sample.parse_sample_config(["--out-dir", str(run_dir), *args]))


def test_the_cli_streams_a_continuation_with_its_header(run_dir):
    proc = run_sample("--out-dir", str(run_dir), "--prompt", "The man", "--max-tokens", "24", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The man") and len(proc.stdout) > len("The man\n")
    assert "checkpoint step 8 (" in proc.stderr  # the newest complete one
    assert "depth 2, width 64, heads 2, seq_len 32, windows [16, 32], vocab 512" in proc.stderr
    assert " tok/s" in proc.stderr


def test_a_seed_repeats_its_text_and_another_seed_differs(run_dir, capsys):
    common = ["--out-dir", str(run_dir), "--max-tokens", "40", "--temperature", "1.0", "--top-k", "0"]
    texts = [sample_in_process(capsys, *common, "--seed", seed) for seed in ("3", "3", "4")]
    assert [code for code, _, _ in texts] == [0, 0, 0]
    assert texts[0][1] == texts[1][1]
    assert texts[0][1] != texts[2][1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_kv_cache_gives_the_tokens_of_the_whole_context_read_anew_past_seq_len(run_dir, temperature):
    """Greedy and sampled, 3 x seq_len tokens: the context is cut several times. The reference
    is the documented rule written out: plain forwards over the context, the newest half kept
    when it would overflow (greedy only: sampled, both paths must simply agree)."""
    model, tokenizer = (got := loaded(run_dir)).model, got.tokenizer
    prompt = [tokenizer.bos_id] + tokenizer.encode("It was the best of times, it was the worst")
    n = 3 * SEQ_LEN
    cached = model.generate(prompt, n, temperature=temperature, seed=5)
    uncached = model.generate(prompt, n, temperature=temperature, seed=5, kv_cache=False)
    assert len(cached) == n and cached == uncached
    if temperature:
        return
    context, reference = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            reference.append(int(model(torch.tensor([context]))[0, -1].argmax()))
            context.append(reference[-1])
            if len(context) > SEQ_LEN:
                context = context[-kept_context(SEQ_LEN):]
    assert cached == reference


def test_cached_logits_are_those_of_the_whole_context(run_dir):
    """Position by position, to the last bit that matters: a trained model this small rarely lets
    one attention layer's error flip a sampled token, so tokens alone would miss it. Prefilled 8
    tokens, then one a step, past the short layer's window (16) up to seq_len."""
    model = loaded(run_dir).model
    tokens = torch.randint(0, model.cfg.vocab_size, (1, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        whole = model(tokens)
        steps = [model.logits(model.hidden(tokens[:, :8], cache))]
        steps += [model.logits(model.hidden(tokens[:, t:t + 1], cache)) for t in range(8, SEQ_LEN)]
    assert model.windows == [SEQ_LEN // 2, SEQ_LEN] and cache.pos == SEQ_LEN
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-4)


def test_top_k_1_is_greedy(run_dir):
    model, tokenizer = (got := loaded(run_dir)).model, got.tokenizer
    prompt = [tokenizer.bos_id] + tokenizer.encode("Never")
    assert model.generate(prompt, 48, temperature=1.5, top_k=1, seed=9) == model.generate(prompt, 48)


def test_step_picks_an_older_complete_checkpoint(run_dir, capsys):
    common = ["--out-dir", str(run_dir), "--max-tokens", "32", "--temperature", "0"]
    code, older, err = sample_in_process(capsys, *common, "--step", "4")
    assert code == 0 and "checkpoint step 4 (" in err
    code, newest, err = sample_in_process(capsys, *common)
    assert code == 0 and "checkpoint step 8 (" in err
    assert older != newest  # four more steps of training changed what the model says


def test_a_copy_of_model_pt_and_complete_alone_samples(run_dir, tmp_path, capsys):
    """What the controller gets from fetching one step: no optimizer states (rank*.pt)."""
    copy = tmp_path / "fetched" / "checkpoints" / "step_000008"
    copy.mkdir(parents=True)
    for name in ("model.pt", "COMPLETE"):
        shutil.copy(run_dir / "checkpoints" / "step_000008" / name, copy / name)
    common = ["--max-tokens", "16", "--temperature", "0"]
    fetched = sample_in_process(capsys, "--out-dir", str(tmp_path / "fetched"), *common)
    there = sample_in_process(capsys, "--out-dir", str(run_dir), *common)
    assert fetched[0] == 0 and fetched[1] == there[1]


def test_a_missing_step_names_the_steps_there_are(run_dir, capsys):
    code, _, err = sample_in_process(capsys, "--out-dir", str(run_dir), "--step", "5")
    assert code == 2
    assert "--step=5: no complete checkpoint at step 5" in err
    assert "the complete steps there: 4, 8" in err and "fix: --step one of them" in err


def test_an_empty_dir_is_refused_by_the_cli_with_the_fix(tmp_path):
    proc = run_sample("--out-dir", str(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--out-dir={tmp_path} holds no complete checkpoint" in proc.stderr and "fix:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_another_tokenizer_is_refused_naming_both(run_dir, tiny_tokenizer_dir, tmp_path, capsys):
    """Same tokens, other bytes (pretty-printed): the recorded sha256 is what decides."""
    raw = json.loads((tiny_tokenizer_dir / TOKENIZER_FILE).read_text())
    (tmp_path / TOKENIZER_FILE).write_text(json.dumps(raw, indent=1))
    right = Tokenizer.load(tiny_tokenizer_dir).content_hash()
    wrong = Tokenizer.load(tmp_path).content_hash()
    code, _, err = sample_in_process(capsys, "--out-dir", str(run_dir), "--tokenizer-dir", str(tmp_path))
    assert code == 2
    assert f"--tokenizer-dir={tmp_path}: its tokenizer (sha256 {wrong[:16]}" in err
    assert f"trained with (sha256 {right[:16]}" in err and "fix: --tokenizer-dir pointing at the run's" in err


def test_a_checkpoint_without_the_models_shape_names_the_fix(run_dir, tmp_path, capsys):
    """Checkpoints sealed before the marker recorded the shape."""
    old = tmp_path / "checkpoints" / "step_000008"
    shutil.copytree(run_dir / "checkpoints" / "step_000008", old)
    marker = json.loads((old / "COMPLETE").read_text())
    del marker["model"]
    (old / "COMPLETE").write_text(json.dumps(marker))
    code, _, err = sample_in_process(capsys, "--out-dir", str(tmp_path))
    assert code == 2
    assert "does not record the model's shape" in err and "fix: resume the run with this version" in err


def test_interactive_answers_each_line_until_the_empty_one(run_dir, capsys):
    common = ["--out-dir", str(run_dir), "--max-tokens", "12", "--temperature", "0"]
    alone = [sample_in_process(capsys, *common, "--prompt", p)[1] for p in ("The cat", "A man")]
    proc = run_sample(*common, "--interactive", stdin="The cat\nA man\n\nnever read\n")
    assert proc.returncode == 0, proc.stderr
    # each answer is the one-shot continuation without the prompt, a newline after it
    assert proc.stdout == alone[0].removeprefix("The cat") + alone[1].removeprefix("A man")


def test_text_streams_whole_characters_only(tiny_tokenizer_dir):
    """Byte-level tokens cut multi-byte characters (a tokenizer trained on English has no tokens
    for these): no piece may hold a replacement character, and the pieces make the text."""
    tokenizer = Tokenizer.load(tiny_tokenizer_dir)
    text = "héllo wörld, 日本語 🙂 ok"
    stream = sample.TextStream(tokenizer)
    pieces = [stream.push(t) for t in tokenizer.encode(text)] + [stream.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text
    assert "" in pieces  # some token did end inside a character and waited
