"""What in a corpus would hurt a run: the report, prepare's options, the held-out pick, verify's reading."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import english_like_docs

from nanochat_cpu import corpus_report, data, dataset_build
from nanochat_cpu.tokenizer import Tokenizer
from tests.test_faults_trainer import rewrite_manifest_entry

# the outlier that once wrecked a run: one PostScript file among prose
POSTSCRIPT = "%!PS-Adobe-3.0\n" + "0 0 moveto 100 100 lineto stroke\n" * 5000  # 165,015 characters
NUMBERS = "\n".join(" ".join(f"{(7 * i + j) % 1000:4d}" for j in range(12)) for i in range(40))  # a table
PS_DOC = POSTSCRIPT.replace("\n", " ").rstrip()  # the one paragraph prepare reads from manual.ps
PROSE = "The document is long, but it is prose all the same, sentence after sentence. " * 40  # 3,080 characters


def report_of(docs: list[str]) -> corpus_report.CorpusReport:
    return corpus_report.corpus_report([corpus_report.Docs("all", "", [f"doc {i}" for i in range(len(docs))], docs)])


def test_ordinary_documents_give_no_warning() -> None:
    report = report_of(english_like_docs(300))
    assert report.warnings == [] and report.non_text_count == 0 and report.duplicates == 0
    assert report.splits["all"].documents == 300


def test_report_flags_a_giant_repetitive_document_and_its_share() -> None:
    docs = english_like_docs(300)
    docs.insert(17, POSTSCRIPT)
    report = report_of(docs)
    stats = report.splits["all"]
    assert stats.longest[0] == (len(POSTSCRIPT), None, "doc 17")
    assert len(POSTSCRIPT) / stats.chars > 0.8
    [line] = report.warnings
    assert line.startswith(f"WARNING: doc 17: {len(POSTSCRIPT):,} characters, over the 100,000 cap (")
    assert "--max-doc-chars 100000 --long-docs crop" in line
    printed = corpus_report.report_lines(report)
    assert f"    {len(POSTSCRIPT):,} characters {len(POSTSCRIPT) / stats.chars:.1%}: doc 17" in printed


def test_report_flags_a_document_by_share_below_the_cap() -> None:
    docs = english_like_docs(300)
    docs.append(PROSE)  # under the cap, but over 1% and 20x the median document
    report = report_of(docs)
    [line] = report.warnings
    share = len(PROSE) / report.splits["all"].chars
    assert line.startswith(f"WARNING: doc 300: {share:.1%} of all characters (3,080; threshold 1%, and 20x the median")
    assert "--long-docs crop" in line


def test_a_share_warnings_suggested_cap_clears_it() -> None:
    docs = english_like_docs(3000) + ["A long document all the same. " * 1700]  # 51,000 characters
    [line] = report_of(docs).warnings
    cap = int(line.split("--max-doc-chars ")[1].split()[0])
    cropped, _ = corpus_report.cap_long_documents([(str(i), d) for i, d in enumerate(docs)], cap, "crop")
    assert report_of([text for _, text in cropped]).warnings == [], cap


def test_report_flags_binary_and_non_text_documents() -> None:
    docs = english_like_docs(50) + ["text, then a NUL\x00byte", NUMBERS, "42", "$3,000,000."]
    report = report_of(docs)
    assert report.non_text == [("doc 50", "a NUL byte"), ("doc 51", report.non_text[1][1])]
    assert report.non_text[1][1].startswith("letter ratio 0.00")
    assert report.non_text_count == 2  # too short to judge: "42" is a fine fortune
    assert ("WARNING: doc 50 looks binary or non-text: a NUL byte; fix, unless it is meant to be learnt: "
            "prepare --drop-binary") in report.warnings
    assert any(w.startswith("WARNING: doc 51 looks binary or non-text: letter ratio") for w in report.warnings)


def test_report_counts_duplicates_and_the_biggest_groups() -> None:
    docs = english_like_docs(300)
    docs += [docs[5]] * 11 + [docs[9]] * 2
    report = report_of(docs)
    assert report.duplicates == 13
    assert report.duplicate_groups[:2] == [(12, len(docs[5]), "doc 5"), (3, len(docs[9]), "doc 9")]
    [line] = report.warnings
    assert f"13 documents ({13 / len(docs):.1%}) repeat another exactly, the most copied 12x" in line
    assert "prepare --dedupe" in line


def test_report_counts_tokens_per_shard(tiny_data_dir: Path, tiny_tokenizer_dir: Path) -> None:
    report = corpus_report.corpus_report(data.shard_docs(tiny_data_dir), tiny_tokenizer_dir)
    tok = Tokenizer.load(tiny_tokenizer_dir)
    texts = [t for group in data.iter_texts(tiny_data_dir, "val") for t in group]
    val_tokens = sum(len(tok.encode(t)) for t in texts)
    assert report.shard_tokens["shard_00007.parquet"] == report.splits["val"].tokens == val_tokens
    assert len(report.shard_tokens) == 8
    n, tokens, name = report.splits["val"].longest[0]
    assert n == max(map(len, texts)) and name.startswith("shard_00007.parquet row group ")
    group, row = (int(x) for x in name.split("row group ")[1].split(" row "))
    assert tokens == len(tok.encode(data.read_texts(tiny_data_dir, ("shard_00007.parquet", group))[row]))


# -----------------------------------------------------------------------------
# prepare acts on them, and says so


def outlier_sources(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    prose = english_like_docs(200)
    (src / "prose.txt").write_text("\n\n".join(prose + prose[:3]))  # 3 exact duplicates
    (src / "manual.ps").write_text(PS_DOC)
    (src / "table.txt").write_text(NUMBERS.replace("\n", " "))
    return src


def shard_texts(out: Path) -> list[str]:
    return [t for split in ("train", "val") for group in data.iter_texts(out, split) for t in group]


def test_prepare_warns_by_default_and_keeps_every_document(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = outlier_sources(tmp_path)
    assert data.main(["prepare", "--source", str(src), "--out", str(tmp_path / "o"), "--rows-per-group", "16"]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: {src / 'manual.ps'} doc 1: {len(PS_DOC):,} characters, over the 100,000 cap" in out
    assert f"WARNING: {src / 'table.txt'} doc 1 looks binary or non-text" in out
    assert "prepare: " not in out  # nothing removed
    assert len(shard_texts(tmp_path / "o")) == 205


def test_prepare_crops_and_drops_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = outlier_sources(tmp_path)
    argv = ["prepare", "--source", str(src), "--out", str(tmp_path / "o"), "--rows-per-group", "16",
            "--max-doc-chars", "5000", "--long-docs", "crop", "--drop-binary", "--dedupe"]
    assert data.main(argv) == 0
    out = capsys.readouterr().out
    table = src / "table.txt"
    assert f"prepare: --drop-binary: 1 document(s), {len(NUMBERS):,} characters removed: {table} doc 1" in out
    assert "prepare: --dedupe: 3 document(s), " in out and f"{src / 'prose.txt'} doc 201" in out
    cropped = len(PS_DOC) - 5000
    assert (f"prepare: --long-docs crop (to 5,000 characters): 1 document(s), {cropped:,} characters removed: "
            f"{src / 'manual.ps'} doc 1") in out
    texts = shard_texts(tmp_path / "o")
    assert len(texts) == 201 and len(set(texts)) == 201
    assert max(map(len, texts)) == 5000 and NUMBERS.replace("\n", " ") not in texts

    argv[argv.index("crop")] = "drop"
    assert data.main(argv) == 0
    assert f"prepare: --long-docs drop (over 5,000 characters): 1 document(s), {len(PS_DOC):,} characters" in (
        capsys.readouterr().out
    )
    texts = shard_texts(tmp_path / "o")
    assert len(texts) == 200 and max(map(len, texts)) < 5000


def test_prepare_refuses_an_unknown_long_docs_action(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--long-docs must be one of warn, crop, drop"):
        dataset_build.prepare([outlier_sources(tmp_path)], tmp_path / "o", long_docs="trim")


# -----------------------------------------------------------------------------
# the held-out shard is representative


@pytest.mark.parametrize("outlier", [POSTSCRIPT, PROSE, "binary\x00" * 30], ids=["over-cap", "share", "binary"])
def test_outliers_go_to_train_not_the_holdout_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], outlier: str
) -> None:
    docs = english_like_docs(400) + [outlier]
    holdout = 40
    # a seed whose shuffle puts the outlier among the last `holdout`: where it would have gone
    seed = next(s for s in range(100) if outlier in (lambda d: random.Random(s).shuffle(d) or d)(list(docs))[-holdout:])
    shuffled = list(docs)
    random.Random(seed).shuffle(shuffled)
    manifest = dataset_build.write_shards(docs, tmp_path, rows_per_group=20, groups_per_shard=2, val_docs=holdout,
                                          seed=seed)
    held = data.read_texts(tmp_path, (manifest["val_file"], 0)) + data.read_texts(tmp_path, (manifest["val_file"], 1))
    assert outlier not in held and len(held) == holdout
    # its place goes to the next document of the shuffle; the rest stay in order
    assert held == [d for d in shuffled[-holdout - 1 :] if d != outlier]
    assert sorted(shard_texts(tmp_path)) == sorted(docs)
    assert f"val shard: 1 outlier document(s), {len(outlier):,} characters, went to train instead" in (
        capsys.readouterr().out
    )


def test_a_long_document_that_would_dominate_the_chosen_val_shard_goes_to_train_too() -> None:
    """One giant document leaves for train; the next-longest, small beside it but 29% of the val shard
    once it is gone, follows it: the warning's rule on the shard chosen, not the corpus's mean."""
    docs = ["word " * 20] * 1000 + ["x " * 500_000, "a longer paragraph " * 210]
    docs = [f"{i} {d}" for i, d in enumerate(docs)]
    chosen, outliers = corpus_report.choose_val(docs, 100)
    sizes = sorted((len(docs[i]) for i in chosen), reverse=True)
    assert len(chosen) == 100 and outliers == 2 and sizes[0] < 0.05 * sum(sizes)
    assert 1000 not in chosen and 1001 not in chosen


def test_an_ordinary_corpus_splits_as_before() -> None:
    """Nothing flagged: the val shard is the shuffle's last documents, in order, as before the report."""
    docs = english_like_docs(500, seed=7)
    chosen, outliers = corpus_report.choose_val(docs, 50)
    assert outliers == 0 and chosen == set(range(450, 500))


def test_prepare_prints_the_holdout_shards_largest_share(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = outlier_sources(tmp_path)
    dataset_build.prepare([src], tmp_path / "o", rows_per_group=16, val_docs=100)
    held = [t for g in data.iter_texts(tmp_path / "o", "val") for t in g]
    share = max(map(len, held)) / sum(map(len, held))
    assert f"  val shard: its largest document is {share:.1%} of its characters (threshold 5%): " in (
        capsys.readouterr().out
    )
    assert share < corpus_report.VAL_DOC_SHARE and PS_DOC not in held and NUMBERS.replace("\n", " ") not in held


# -----------------------------------------------------------------------------
# verify reads every shard


@pytest.fixture
def data_copy(tiny_data_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_data_dir, tmp_path / "data"))


def replace_shard(data_dir: Path, name: str, table: pa.Table, **write: object) -> None:
    pq.write_table(table, data_dir / name, **write)
    rewrite_manifest_entry(data_dir, name)


def verify_line(data_dir: Path, name: str) -> str:
    [line] = data.verify(data_dir)
    assert line.startswith(f"data verify FAILED on {socket.gethostname()}: {name}: ")
    assert line.endswith("(fix: prepare, corpus or fetch the dataset again on the controller, then re-run site.yml)")
    return line


def test_verify_refuses_a_shard_without_a_text_column(data_copy: Path) -> None:
    replace_shard(data_copy, "shard_00003.parquet", pa.table({"body": ["a document", "another"]}))
    assert "shard_00003.parquet: no 'text' column (columns ['body'])" in verify_line(data_copy, "shard_00003.parquet")
    [problem] = data.check_dataset(data_copy, world_size=1)  # the trainer's check reads it from the footer
    assert "shard_00003.parquet: no 'text' column (columns ['body'])" in problem


def test_verify_takes_text_in_any_string_layout_beside_other_columns(data_copy: Path) -> None:
    """polars writes string views, pandas may dictionary-encode, a fetched dataset has ids and urls:
    the loader reads each of them as strings, so verify and the trainer's check take them."""
    texts = ["the first document", "the second", "the first document"]
    shards = {"shard_00001.parquet": pa.table({"text": pa.array(texts, pa.string_view())}),
              "shard_00002.parquet": pa.table({"text": pa.array(texts).dictionary_encode()}),
              "shard_00003.parquet": pa.table({"id": [1, 2, 3], "text": texts, "url": ["u", "v", "w"]})}
    for name, table in shards.items():
        replace_shard(data_copy, name, table)
    assert data.verify(data_copy) == [] and data.check_dataset(data_copy, world_size=1) == []
    assert all(data.read_texts(data_copy, (name, 0)) == texts for name in shards)


def test_verify_words_an_empty_and_a_garbage_shard_as_the_trainer_does(data_copy: Path) -> None:
    # train.yml's preflight runs verify before the trainer's check: the same fault, the same words
    replace_shard(data_copy, "shard_00001.parquet", pa.table({"text": pa.array([], pa.string())}))
    (data_copy / "shard_00002.parquet").write_bytes(b"not a parquet file " * 200)
    rewrite_manifest_entry(data_copy, "shard_00002.parquet")
    empty, garbage = data.verify(data_copy)
    trainer = data.check_dataset(data_copy, world_size=1)
    for line in (empty, trainer[0]):
        assert "shard_00001.parquet: empty shard (0 rows)" in line
    for line in (garbage, trainer[1]):
        assert "shard_00002.parquet: not a readable parquet file" in line


def test_verify_refuses_a_text_column_that_is_not_strings(data_copy: Path) -> None:
    replace_shard(data_copy, "shard_00001.parquet", pa.table({"text": pa.array([1, 2, 3], pa.int64())}))
    assert "column 'text' is int64, expected string" in verify_line(data_copy, "shard_00001.parquet")


def test_verify_refuses_a_null_document_and_reads_large_strings(data_copy: Path) -> None:
    texts = data.read_texts(data_copy, ("shard_00001.parquet", 0))
    replace_shard(data_copy, "shard_00001.parquet", pa.table({"text": pa.array(texts, pa.large_string())}))
    assert data.verify(data_copy) == []
    replace_shard(data_copy, "shard_00001.parquet", pa.table({"text": pa.array(["a", None, "b"], pa.string())}),
                  row_group_size=2)
    assert ": row group 0: 1 null document(s) " in verify_line(data_copy, "shard_00001.parquet")


def test_verify_reads_every_row_group_and_names_a_corrupt_page(data_copy: Path) -> None:
    name = "shard_00002.parquet"
    texts = [t for g in range(4) for t in data.read_texts(data_copy, (name, g))]
    replace_shard(data_copy, name, pa.table({"text": pa.array(texts, pa.string())}), row_group_size=64,
                  compression="none", use_dictionary=False)
    meta = pq.read_metadata(data_copy / name).row_group(2).column(0)
    middle = meta.data_page_offset + meta.total_compressed_size // 2
    raw = bytearray((data_copy / name).read_bytes())
    raw[middle : middle + 16] = b"\xff" * 16
    (data_copy / name).write_bytes(bytes(raw))
    rewrite_manifest_entry(data_copy, name)  # the sha256 matches: only reading finds it
    assert pq.read_metadata(data_copy / name).num_rows == 256  # the footer still reads
    assert data.check_dataset(data_copy, world_size=1) == []  # the trainer's fast check cannot see it
    line = verify_line(data_copy, name)
    assert f"{name}: row group 2: unreadable (" in line

    cmd = [sys.executable, "-m", "nanochat_cpu.data", "verify", "--data-dir", str(data_copy)]
    bad = subprocess.run(cmd, capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.strip() == line and "corpus report" not in bad.stdout


def test_verify_finds_bytes_flipped_inside_a_document(data_copy: Path) -> None:
    # the page decodes (every length prefix intact), but the text is no longer UTF-8
    name = "shard_00004.parquet"
    texts = [t for g in range(4) for t in data.read_texts(data_copy, (name, g))]
    replace_shard(data_copy, name, pa.table({"text": pa.array(texts, pa.string())}), row_group_size=64,
                  compression="none", use_dictionary=False)
    victim = max(texts[64:128], key=len).encode()
    raw = bytearray((data_copy / name).read_bytes())
    at = raw.index(victim) + len(victim) // 2
    raw[at : at + 4] = b"\xff" * 4
    (data_copy / name).write_bytes(bytes(raw))
    rewrite_manifest_entry(data_copy, name)
    assert f"{name}: row group 1: unreadable (ArrowInvalid: " in verify_line(data_copy, name)


def test_verify_cli_prints_the_report_with_tokens(data_copy: Path, tiny_tokenizer_dir: Path) -> None:
    cmd = [sys.executable, "-m", "nanochat_cpu.data", "verify", "--data-dir", str(data_copy),
           "--tokenizer-dir", str(tiny_tokenizer_dir)]
    ok = subprocess.run(cmd, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[0].startswith("data verify OK") and lines[1].startswith("corpus report: 2,048 documents, ")
    assert any(ln.startswith("  val shard: its largest document is ") for ln in lines)
    assert sum(ln.startswith("  shard_0") and ln.endswith(" tokens") for ln in lines) == 8
    # each node's preflight checks only: the controller showed the report once
    quiet = subprocess.run([*cmd[:6], "--no-report"], capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stdout.splitlines() == lines[:1], quiet.stdout
