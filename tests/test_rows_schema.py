"""One row type, one schema per version: ``TrajectoryRow`` and the Arrow schema agree, every file of a
committed version (its parts and its carry-over) has the same columns, so plain Parquet readers take the
version as one table, and versions written before carry_state was in every file still read."""

from __future__ import annotations

import dataclasses
import glob
import os
import types
import typing
from datetime import UTC, datetime

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from storage.paths import CARRYOVER, StorageRoot
from storage.trajectories import (
    COLUMNS,
    SCHEMA_VERSION,
    TrajectoryRow,
    arrow_schema,
    committed_round_version,
    parquet_table,
    read_carryover,
    read_table,
    rows_of,
    rows_to_table,
    stage_rollout,
    table_bytes,
    write_version,
)
from tasks.filter.stage import FilterConfig, run_filter
from tasks.rollout.rows import groups_from_carry
from tasks.round.context import RoundContext

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _row(group: int, index: int, reward: float | None, **fields) -> TrajectoryRow:
    values = dict(
        run_id="run",
        round=1,
        prompt_id=f"p{group}",
        group_id=f"g{group}",
        sample_index=index,
        task="addition",
        prompt_text="1+2=",
        prompt_token_ids=[1, 5, 14, 6, 15],
        reference="3",
        prompt_weight=1.0,
        completion_text="3" if reward else "4",
        completion_token_ids=[7, 2],
        rollout_logprobs=[-0.25, -0.125],
        token_policy_versions=[0, 0],
        finish_reason="stop",
        engine={"name": "embedded", "version": "t", "dtype": "float32"},
        sampling={"temperature": 1.0, "top_p": 1.0, "seed": 1, "max_tokens": 8},
        verifier={"name": "addition", "version": "1"},
        reward=reward,
        outcome=None if reward is None else "success" if reward else "model_failure",
        verify_error=None,
        enqueued_at=NOW,
        started_at=NOW,
        finished_at=NOW,
        verified_at=None if reward is None else NOW,
        gen_latency_s=0.1,
        verify_latency_s=None if reward is None else 0.001,
    )
    return TrajectoryRow(**{**values, **fields})


def _round_rows() -> tuple[list[TrajectoryRow], list[TrajectoryRow]]:
    """Three complete groups (two with signal) and one carried group: two samples verified, two partial."""
    rows = [_row(g, i, float(i % 2) if g < 2 else 1.0) for g in range(3) for i in range(4)]
    partial = dict(
        carry_state="partial", finish_reason="abort", completion_text="", completion_token_ids=[7],
        rollout_logprobs=[-1.0], token_policy_versions=[0],
    )  # fmt: skip
    carry = [_row(3, i, 1.0, carry_state="verified") for i in range(2)] + [_row(3, i, None, **partial) for i in (2, 3)]
    return rows, carry


def _ctx(storage: str) -> RoundContext:
    return RoundContext(
        storage=storage, run_id="run", round=1, experiment="e", parent_checkpoint="/p", parent_policy_version=0,
        parent_model_version="m/1", base_model="b", config_hash="h", code_version="c", flow_run_id="f",
        mlflow_run_id="m", seed=0,
    )  # fmt: skip


def _python_type(arrow_type):
    """The Python type a column's values come back as (``to_pylist``)."""
    for test, python in (
        (pa.types.is_string, str),
        (pa.types.is_integer, int),
        (pa.types.is_floating, float),
        (pa.types.is_boolean, bool),
        (pa.types.is_timestamp, datetime),
        (pa.types.is_struct, dict),
    ):
        if test(arrow_type):
            return python
    assert pa.types.is_list(arrow_type), arrow_type
    return list[_python_type(arrow_type.value_type)]


def _without_none(annotation):
    """``X | None`` -> X: every column is nullable, so the annotation's None says nothing to Arrow."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return annotation


def test_the_row_type_and_the_arrow_schema_agree():
    schema = arrow_schema()
    hints = typing.get_type_hints(TrajectoryRow)
    assert schema.names == [f.name for f in dataclasses.fields(TrajectoryRow)] == list(COLUMNS)  # same order
    for column in schema:
        assert _python_type(column.type) == _without_none(hints[column.name]), column.name


def test_rows_survive_parquet_as_they_were_built():
    rows, carry = _round_rows()
    back = rows_of(parquet_table(table_bytes(rows_to_table(rows + carry))))
    assert back == rows + carry  # float32 logprobs chosen exactly representable
    assert {r.schema_version for r in back} == {SCHEMA_VERSION}


@pytest.fixture
def committed(tmp_path):
    """A round's version committed the way a round commits it: staged by rollout, filtered, committed."""
    root = StorageRoot.of(str(tmp_path / "store"))
    rows, carry = _round_rows()
    staging, carryover = stage_rollout(root, "run", 1, rows, carry)
    result = run_filter(
        ctx=_ctx(root.uri), staging=staging, config=FilterConfig(), target_groups=2,
        rollout_stats={"rollout/wall_s": 1.0}, carryover=carryover,
    )  # fmt: skip
    manifest = committed_round_version(root, "run", 1)
    assert manifest.version == result.version and CARRYOVER in manifest.body["attachments"]
    return root, manifest, rows, carry


def test_every_file_of_a_version_has_the_versions_schema(committed):
    _, manifest, rows, carry = committed
    files = sorted(glob.glob(os.path.join(manifest.directory, "*.parquet")))
    assert [os.path.basename(f) for f in files] == [CARRYOVER, "part-00000.parquet"]
    schemas = [pq.read_schema(f).remove_metadata() for f in files]
    assert all(s.equals(arrow_schema()) for s in schemas)
    # plain readers take the version as one table: the rows and the carry-over, told apart by carry_state
    for table in (
        pq.read_table(files),
        ds.dataset(manifest.directory, format="parquet", exclude_invalid_files=True).to_table(),  # skips manifest.json
        pa.Table.from_pandas(pd.read_parquet(files), preserve_index=False),
        duckdb.sql(f"SELECT * FROM read_parquet('{manifest.directory}/*.parquet')").fetch_arrow_table(),
    ):
        assert table.num_rows == len(rows) + len(carry)
        assert sorted(table.column("carry_state").to_pylist(), key=str) == sorted(
            [None] * len(rows) + [r.carry_state for r in carry], key=str
        )


def test_a_committed_round_reads_back_as_built(committed):
    root, manifest, rows, carry = committed
    stored = read_table(root, manifest)
    assert stored.column_names == [*COLUMNS, "trajectory_version"]
    strip = {"advantage", "kept", "drop_reason"}  # filter's
    assert [{k: v for k, v in r.items() if k in COLUMNS and k not in strip} for r in stored.to_pylist()] == [
        {k: v for k, v in dataclasses.asdict(r).items() if k not in strip} for r in rows
    ]
    assert stored.column("kept").to_pylist() == [True] * 8 + [False] * 4  # the zero-variance group
    assert read_carryover(root, manifest) == carry
    assert [len(g.slots) for g in groups_from_carry(read_carryover(root, manifest))] == [4]


def test_a_version_written_before_carry_state_was_in_every_file_still_reads(tmp_path):
    """Schema 1.1: the parts had no carry_state column, the carry-over had one, and 1.0 had no prompt_weight."""
    root = StorageRoot.of(str(tmp_path / "store"))
    rows, carry = _round_rows()
    old_parts = rows_to_table(rows).drop_columns(["carry_state", "prompt_weight"])
    old_parts = old_parts.set_column(0, "schema_version", pa.array(["1.0"] * old_parts.num_rows))
    old_carry = table_bytes(rows_to_table(carry).drop_columns(["prompt_weight"]))
    meta = {"kind": "rollout", "run_id": "run", "round": 1, "parent": None, "derivation": {}}
    manifest = write_version(
        root, lambda v: root.trajectory_version("run", 1, v), old_parts, meta, {CARRYOVER: old_carry}
    )
    stored = read_table(root, manifest)
    assert stored.column_names == [*COLUMNS, "trajectory_version"]
    assert stored.column("carry_state").null_count == stored.column("prompt_weight").null_count == len(rows)
    assert read_table(root, manifest, columns=["group_id", "carry_state"]).column_names == [
        "group_id", "carry_state", "trajectory_version"
    ]  # fmt: skip
    resumed = read_carryover(root, manifest)
    assert [r.carry_state for r in resumed] == [r.carry_state for r in carry]
    assert all(r.prompt_weight is None for r in resumed)
    assert [g.meta.weight for g in groups_from_carry(resumed)] == [1.0]  # drawn before the curriculum
