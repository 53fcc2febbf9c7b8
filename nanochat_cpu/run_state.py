"""What a run keeps in its checkpoints besides tensors: the run state, typed.

Each rank's checkpoint file holds the optimizer's state, the loader's position and the RNG, and
beside them the run's own facts: its id (run_identity.py), which tokenizer and data it trained
with, its MLflow run, the work split
and whether it was checked, the compile choice, and with local steps the outer optimizer and the
schedule auto chose. They are read back here and nowhere else: the rest of the trainer reads
fields, so a renamed or missing key is found once, in this file.

On disk they stay a plain dict under the rank file's "extra" key, as every checkpoint written
before this type had them: a field an older checkpoint lacks takes its default, and a field this
version no longer knows is dropped with the rest of that old state (nothing reads it).

The COMPLETE marker carries a copy of the run's id, its data and its stepping facts
(`marker_fields`): resume must know whose checkpoint it is, on what data, and how the run steps
before it builds the optimizer, and so before it reads any rank's file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SAVED_KEY = "extra"  # the rank file's key (the name checkpoints have always used)


def _known(cls, saved: dict) -> dict:
    """The entries of `saved` that are fields of `cls`."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in saved.items() if k in names}


def _without_none(obj) -> dict:
    return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None}


@dataclass
class AutoChoice:
    """--sync-every auto's choice, once it timed the synchronous warm-up."""

    synchronous: bool  # every step stays synchronous
    why: str
    warm_until: int | None = None  # with local steps: the step the warm-up ends at
    asked_until: int | None = None  # the end --sync-warmup-ratio asked for (a restart that asks for fewer gets fewer)
    first_phase: int | None = None  # the inner steps before the first outer sync

    @classmethod
    def from_saved(cls, saved: dict) -> AutoChoice:
        return cls(**_known(cls, saved))


@dataclass
class SavedSchedule:
    """With local steps, at an outer boundary: where the outer syncs fall, and what auto chose."""

    first: int  # the first boundary after the phases began
    every: int | None  # H (None: auto has not chosen it yet)
    land_after: int | None = None  # --outer-overlap: inner steps an overlapped sync crosses in (None: not timed)
    overlap: bool | None = None  # what --outer-overlap auto chose (None: not yet, or on/off was asked for)

    @classmethod
    def from_saved(cls, saved: dict) -> SavedSchedule:
        return cls(**_known(cls, saved))


@dataclass
class RunState:
    run_id: str | None = None  # None: a checkpoint from before runs had ids (taken as this run's)
    tokenizer_sha256: str | None = None  # None: a checkpoint from before it was kept (taken as this one)
    vocab_size: int | None = None
    data_sha256: str | None = None  # the data manifest's sha256 (None: from before it was kept)
    mlflow_run_id: str | None = None
    rank_batch_sizes: list[int] | None = None  # each rank's rows per micro-step
    split_settled: bool = False  # whether the split was checked against the run's own steps
    split_fixed_rows: float = 0.0  # a micro-batch's fixed cost in rows (checkpoints before it: rows alone)
    compile: dict | None = None  # CompileChoice.state_dict()
    auto_choice: AutoChoice | None = None
    outer: dict | None = None  # the outer optimizer's state: present exactly where the run has local steps
    sync_schedule: SavedSchedule | None = None

    @property
    def local_steps(self) -> bool:
        return self.outer is not None

    # ---- to and from a checkpoint ---------------------------------------------------------------

    def to_saved(self) -> dict[str, Any]:
        saved = {"run_id": self.run_id, "data_sha256": self.data_sha256,
                 "mlflow_run_id": self.mlflow_run_id, "rank_batch_sizes": self.rank_batch_sizes,
                 "split_settled": self.split_settled, "split_fixed_rows": self.split_fixed_rows,
                 "tokenizer_sha256": self.tokenizer_sha256, "vocab_size": self.vocab_size, "compile": self.compile}
        if self.auto_choice is not None:
            saved["auto_choice"] = _without_none(self.auto_choice)
        if self.outer is not None:
            saved["outer"] = self.outer
        if self.sync_schedule is not None:
            saved["sync_schedule"] = dataclasses.asdict(self.sync_schedule)
        return saved

    @classmethod
    def from_saved(cls, saved: dict) -> RunState:
        state = cls(**_known(cls, saved))
        if isinstance(state.auto_choice, dict):
            state.auto_choice = AutoChoice.from_saved(state.auto_choice)
        if isinstance(state.sync_schedule, dict):
            state.sync_schedule = SavedSchedule.from_saved(state.sync_schedule)
        state.split_settled = bool(state.split_settled)
        state.split_fixed_rows = float(state.split_fixed_rows or 0.0)
        return state

    @classmethod
    def of_rank_file(cls, rank_file: dict) -> RunState:
        """The run state in a rank's checkpoint file (its torch.load'ed dict)."""
        return cls.from_saved(rank_file.get(SAVED_KEY) or {})

    # ---- the COMPLETE marker's copy --------------------------------------------------------------

    def marker_fields(self) -> dict[str, Any]:
        """What resume must know before it reads a file: whose it is, on what data, how the run
        steps, and what auto chose."""
        fields = {"run_id": self.run_id, "data_sha256": self.data_sha256, "local_steps": self.local_steps}
        if self.auto_choice is not None:
            fields["auto_choice"] = _without_none(self.auto_choice)
        return fields


def stepping_in_marker(marker: dict) -> tuple[bool, AutoChoice | None]:
    """A COMPLETE marker's stepping facts: whether the checkpoint has local steps, and auto's choice."""
    choice = marker.get("auto_choice")
    return bool(marker.get("local_steps")), AutoChoice.from_saved(choice) if choice is not None else None
