"""The corpus report: what in a corpus's documents would hurt a run, and prepare's remedies.

One 1.77 MB PostScript file among prose once wrecked a model: a document that is most of its
split, binary or non-text content, and exact copies teach the model one thing over and over.
`corpus_report()` reads every document once (as `Docs` batches: data.py's shards, or prepare's
documents before they are written) and says what it found, a WARNING line for each finding over
its threshold naming the document, the value, the threshold and the prepare option that fixes
it. The options themselves (`drop_non_text`, `dedupe_documents`, `cap_long_documents`) and the
choice of an honest val shard (`choose_val`) are here too; dataset_build.py calls them.
"""

from __future__ import annotations

import hashlib
import heapq
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

# The corpus report's thresholds. One document above LONG_DOC_SHARE of its split's characters is
# what the model sees over and over (one PostScript file was once most of a user's corpus). In a
# small corpus every document is above 1%, so it must also be OUTLIER_MEDIANS times the median
# document: long for this corpus, not just one of few.
LONG_DOC_SHARE = 0.01
OUTLIER_MEDIANS = 20
# The default --max-doc-chars: ~25 pages. Longer is a book, a log or a dump rather than a document.
LONG_DOC_CHARS = 100_000
# Fewer letters than this among the visible characters: markup, tables of numbers, hex, or binary
# decoded as text (U+FFFD is no letter). Judged on the first RATIO_SAMPLE_CHARS (binary is binary
# throughout; it keeps the scan cheap) and only from MIN_RATIO_CHARS on: "42" is a fine fortune.
MIN_LETTER_RATIO = 0.25
MIN_RATIO_CHARS = 100
RATIO_SAMPLE_CHARS = 10_000
# A val document alone above this share of the val shard makes val_bpb measure that document,
# not the corpus: prepare puts such documents in train.
VAL_DOC_SHARE = 0.05
# Exact copies: above this share of the documents, or one text this many times, and the model
# learns the copy by heart.
DUPLICATE_SHARE = 0.01
DUPLICATE_COPIES = 10
# Documents named per finding: enough to act on, short enough to read in a play's output.
REPORT_TOP = 5
LONG_DOC_ACTIONS = ("warn", "crop", "drop")


class Docs(NamedTuple):
    """Documents for the report: their split, their shard ('' before they are written), their names."""

    split: str
    shard: str
    names: list[str]
    texts: list[str]


@dataclass
class SplitStats:
    documents: int = 0
    chars: int = 0
    tokens: int | None = None  # None without a tokenizer
    median_chars: float = 0.0
    over_cap: int = 0  # documents longer than the report's max_doc_chars
    longest: list[tuple[int, int | None, str]] = field(default_factory=list)  # (chars, tokens, name), longest first


@dataclass
class CorpusReport:
    splits: dict[str, SplitStats]
    shard_tokens: dict[str, int]  # empty without a tokenizer
    non_text: list[tuple[str, str]]  # (name, why), the first REPORT_TOP
    non_text_count: int
    duplicates: int  # documents that repeat an earlier one exactly
    duplicate_groups: list[tuple[int, int, str]]  # (copies, chars, name of the first), most copies first
    max_doc_chars: int
    warnings: list[str] = field(default_factory=list)


def non_text_reason(text: str) -> str | None:
    """Why a document looks binary or non-text; None when it reads as text."""
    if "\x00" in text:
        return "a NUL byte"
    sample = text[:RATIO_SAMPLE_CHARS]
    visible = len(sample) - sum(map(str.isspace, sample))
    if visible < MIN_RATIO_CHARS:
        return None
    ratio = sum(map(str.isalpha, sample)) / visible
    return f"letter ratio {ratio:.2f} (threshold {MIN_LETTER_RATIO})" if ratio < MIN_LETTER_RATIO else None


def corpus_report(
    batches: Iterable[Docs], tokenizer_dir: str | Path | None = None, max_doc_chars: int = LONG_DOC_CHARS
) -> CorpusReport:
    """Every document once: sizes (and tokens), the longest, the non-text ones, exact duplicates."""
    tok = None
    if tokenizer_dir is not None:
        from .tokenizer import Tokenizer  # here: a report without tokens needs no tokenizers import

        tok = Tokenizer.load(tokenizer_dir)
    lengths: dict[str, list[int]] = {}
    heaps: dict[str, list[tuple[int, int, int | None, str]]] = {}
    splits: dict[str, SplitStats] = {}
    shard_tokens: dict[str, int] = {}
    non_text: list[tuple[str, str]] = []
    non_text_count = 0
    seen: dict[bytes, list[Any]] = {}  # digest -> [copies, chars, name of the first]
    for batch in batches:
        stats = splits.setdefault(batch.split, SplitStats(tokens=0 if tok else None))
        split_lengths, heap = lengths.setdefault(batch.split, []), heaps.setdefault(batch.split, [])
        counts = [len(ids) for ids in tok.encode_batch(batch.texts)] if tok else None
        if counts is not None:
            stats.tokens = (stats.tokens or 0) + sum(counts)
            if batch.shard:
                shard_tokens[batch.shard] = shard_tokens.get(batch.shard, 0) + sum(counts)
        for i, (name, text) in enumerate(zip(batch.names, batch.texts, strict=True)):
            n = len(text)
            split_lengths.append(n)
            stats.over_cap += n > max_doc_chars
            # -order: of equal lengths the first read stays, and None tokens are never compared
            entry = (n, -len(split_lengths), None if counts is None else counts[i], name)
            if len(heap) < REPORT_TOP:
                heapq.heappush(heap, entry)
            elif entry > heap[0]:
                heapq.heapreplace(heap, entry)
            if (why := non_text_reason(text)) is not None:
                non_text_count += 1
                if len(non_text) < REPORT_TOP:
                    non_text.append((name, why))
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if (group := seen.get(digest)) is not None:
                group[0] += 1
            else:
                seen[digest] = [1, n, name]
    for split, stats in splits.items():
        stats.documents, stats.chars = len(lengths[split]), sum(lengths[split])
        stats.median_chars = statistics.median(lengths[split]) if lengths[split] else 0.0
        stats.longest = [(n, tokens, name) for n, _, tokens, name in sorted(heaps[split], reverse=True)]
    groups = heapq.nlargest(REPORT_TOP, ((c, n, name) for c, n, name in seen.values() if c > 1))
    duplicates = sum(c - 1 for c, _, _ in seen.values())
    report = CorpusReport(splits, shard_tokens, non_text, non_text_count, duplicates, groups, max_doc_chars)
    report.warnings = report_warnings(report)
    return report


def _long_doc_floor(stats: SplitStats) -> float:
    """Shorter than this is no outlier however few the documents: OUTLIER_MEDIANS x the median."""
    return OUTLIER_MEDIANS * stats.median_chars


def report_warnings(report: CorpusReport) -> list[str]:
    """One WARNING line per finding over its threshold: the document, the value, the threshold, the fix."""
    cap, lines = report.max_doc_chars, []
    for split, stats in report.splits.items():
        named_over_cap = 0
        # a cap that clears every share warning: cropped to N, each of the k flagged documents is
        # N / (the rest + k N) of the split, at most LONG_DOC_SHARE when N <= s * rest / (1 - s k)
        flagged = [n for n, _, _ in stats.longest
                   if n <= cap and n / max(stats.chars, 1) > LONG_DOC_SHARE and n > _long_doc_floor(stats)]
        rest = stats.chars - sum(flagged)
        suggest = max(int(LONG_DOC_SHARE * rest / (1 - LONG_DOC_SHARE * len(flagged))), int(_long_doc_floor(stats)))
        for n, _, name in stats.longest:
            share = n / max(stats.chars, 1)
            if n > cap:
                named_over_cap += 1
                lines.append(f"WARNING: {name}: {n:,} characters, over the {cap:,} cap ({share:.1%} of {split} "
                             f"characters); fix: prepare --max-doc-chars {cap} --long-docs crop (or drop)")
            elif share > LONG_DOC_SHARE and n > _long_doc_floor(stats):
                lines.append(f"WARNING: {name}: {share:.1%} of {split} characters ({n:,}; threshold "
                             f"{LONG_DOC_SHARE:.0%}, and {OUTLIER_MEDIANS}x the median document); fix: prepare "
                             f"--max-doc-chars {suggest} --long-docs crop (or drop)")
        if stats.over_cap > named_over_cap:
            lines.append(f"WARNING: {stats.over_cap - named_over_cap:,} more {split} document(s) over the {cap:,} "
                         f"cap; fix: prepare --max-doc-chars {cap} --long-docs crop (or drop)")
        if split == "val" and stats.longest:
            n, _, name = stats.longest[0]
            if n / max(stats.chars, 1) > VAL_DOC_SHARE and n > _long_doc_floor(stats):
                lines.append(f"WARNING: {name} alone is {n / stats.chars:.1%} of the val shard's characters "
                             f"(threshold {VAL_DOC_SHARE:.0%}): val_bpb would measure this one document; fix: "
                             f"prepare the data again (prepare keeps such documents out of the val shard)")
    for name, why in report.non_text:
        lines.append(f"WARNING: {name} looks binary or non-text: {why}; fix, unless it is meant to be "
                     f"learnt: prepare --drop-binary")
    if report.non_text_count > len(report.non_text):
        lines.append(f"WARNING: {report.non_text_count - len(report.non_text):,} more non-text document(s); "
                     f"fix, unless they are meant to be learnt: prepare --drop-binary")
    documents = sum(s.documents for s in report.splits.values())
    most = report.duplicate_groups[0][0] if report.duplicate_groups else 0
    if report.duplicates > DUPLICATE_SHARE * documents or most >= DUPLICATE_COPIES:
        copies, n, name = report.duplicate_groups[0]
        lines.append(f"WARNING: {report.duplicates:,} documents ({report.duplicates / documents:.1%}) repeat "
                     f"another exactly, the most copied {copies}x ({n:,} characters, first {name}); threshold "
                     f"{DUPLICATE_SHARE:.0%} of the documents or {DUPLICATE_COPIES} copies of one; fix: "
                     f"prepare --dedupe (keeps the first of each)")
    return lines


def val_share_line(stats: SplitStats) -> str:
    n, _, name = stats.longest[0] if stats.longest else (0, None, "-")
    return (f"  val shard: its largest document is {n / max(stats.chars, 1):.1%} of its characters "
            f"(threshold {VAL_DOC_SHARE:.0%}): {name}")


def report_lines(report: CorpusReport) -> list[str]:
    """The printed form: totals, each split, its longest documents, non-text, duplicates, then the warnings."""
    documents = sum(s.documents for s in report.splits.values())
    chars = sum(s.chars for s in report.splits.values())
    lines = [f"corpus report: {documents:,} documents, {chars:,} characters"]
    for split, stats in report.splits.items():
        tokens = f", {stats.tokens:,} tokens" if stats.tokens is not None else ""
        lines.append(f"  {split}: {stats.documents:,} documents, {stats.chars:,} characters{tokens}, "
                     f"median document {stats.median_chars:,.0f} characters")
        if split == "val":
            lines.append(val_share_line(stats))
        lines.append(f"  {split}: longest documents (share of {split} characters"
                     f"{' and tokens' if stats.tokens is not None else ''}):")
        for n, tok_n, name in stats.longest:
            share = f"{n:,} characters {n / max(stats.chars, 1):.1%}"
            if tok_n is not None:
                share += f", {tok_n:,} tokens {tok_n / max(stats.tokens or 0, 1):.1%}"
            lines.append(f"    {share}: {name}")
    lines += [f"  {shard}: {tokens:,} tokens" for shard, tokens in report.shard_tokens.items()]
    lines.append(f"  non-text documents: {report.non_text_count:,} (a NUL byte, or letters under "
                 f"{MIN_LETTER_RATIO:.0%} of the visible characters)")
    biggest = "; ".join(f"{c}x {n:,} characters ({name})" for c, n, name in report.duplicate_groups)
    lines.append(f"  exact duplicates: {report.duplicates:,} documents repeat another"
                 + (f" (most copied: {biggest})" if biggest else ""))
    return lines + report.warnings


# What prepare's options remove: each returns the documents kept and (name, characters removed).
Removed = list[tuple[str, int]]


def drop_non_text(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], Removed]:
    flagged = [non_text_reason(text) is not None for _, text in docs]
    kept = [doc for doc, bad in zip(docs, flagged, strict=True) if not bad]
    return kept, [(name, len(text)) for (name, text), bad in zip(docs, flagged, strict=True) if bad]


def dedupe_documents(docs: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], Removed]:
    """The first of each exact text; the order of the rest is kept (prepare's shuffle is seeded on it)."""
    seen: set[str] = set()
    kept, removed = [], []
    for name, text in docs:
        if text in seen:
            removed.append((name, len(text)))
        else:
            seen.add(text)
            kept.append((name, text))
    return kept, removed


def cap_long_documents(
    docs: list[tuple[str, str]], max_doc_chars: int, action: str
) -> tuple[list[tuple[str, str]], Removed]:
    """--long-docs crop keeps the first max_doc_chars characters, drop leaves the document out."""
    kept, removed = [], []
    for name, text in docs:
        if len(text) <= max_doc_chars or action == "warn":
            kept.append((name, text))
        elif action == "crop":
            kept.append((name, text[:max_doc_chars]))
            removed.append((name, len(text) - max_doc_chars))
        else:
            removed.append((name, len(text)))
    return kept, removed


def removed_line(what: str, removed: Removed) -> str:
    """Nothing leaves the corpus unsaid: how many documents, how many characters, which."""
    names = ", ".join(name for name, _ in removed[:REPORT_TOP]) + (", ..." if len(removed) > REPORT_TOP else "")
    chars = sum(n for _, n in removed)
    said = f"prepare: {what}: {len(removed):,} document(s), {chars:,} characters removed"
    return said + (f": {names}" if names else "")


def choose_val(docs: Sequence[str], val_docs: int) -> tuple[set[int], int]:
    """The val documents' indices, and how many outliers were passed over: the last val_docs of the
    (shuffled) documents that are no outliers. An outlier is non-text, over LONG_DOC_CHARS, or alone
    more than VAL_DOC_SHARE of the val shard chosen and OUTLIER_MEDIANS times its median document
    (the report's warning, so a val shard prepared here never earns it): chosen again without it
    until none is. With none flagged that is the last val_docs, as ordinary corpora always split."""
    lengths = [len(d) for d in docs]
    outlier = [n > LONG_DOC_CHARS or non_text_reason(d) is not None for n, d in zip(lengths, docs, strict=True)]
    while True:
        chosen = pick_val(outlier, val_docs)
        sizes = [lengths[i] for i in chosen]
        total, floor = sum(sizes), OUTLIER_MEDIANS * statistics.median(sizes)
        big = [i for i in chosen if not outlier[i] and lengths[i] > VAL_DOC_SHARE * total and lengths[i] > floor]
        if not big:
            return chosen, sum(outlier)
        for i in big:
            outlier[i] = True


def pick_val(outlier: list[bool], val_docs: int) -> set[int]:
    """The val documents' indices: the last val_docs that are no outliers (outliers only when too
    few are clean). With none flagged that is the last val_docs, as ordinary corpora always split."""
    last_first = range(len(outlier) - 1, -1, -1)
    order = [i for i in last_first if not outlier[i]] + [i for i in last_first if outlier[i]]
    return set(order[:val_docs])
