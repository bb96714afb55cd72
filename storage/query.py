"""Questions asked of a committed trajectory version: SQL row selection, summary statistics, export.

DuckDB runs over the version's Parquet parts *after* ``read_table`` has verified every part's sha256,
as a zero-copy Arrow table: the same code serves a local root and S3, and SQL never sees unverified
bytes. Predicates are parsed by DuckDB as one expression (no hand-written parser, no second
statement), and the connection cannot read files or reach the network, so a predicate can only look
at the rows in front of it.

Selection returns row positions, and the rows are taken from the original Arrow table: the schema is
exactly the store's (no type round trip through SQL) and the stored order is kept, which is the order
training takes groups in.
"""

from __future__ import annotations

import json
from datetime import date, datetime
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from storage.settings import filesystem_for

TABLE = "trajectories"
_ROW = "__row"
EXPORT_FORMATS = ("jsonl", "parquet")


class QueryError(ValueError):
    """A predicate DuckDB cannot evaluate, or an export that cannot be written; one line."""


def _connect():
    # No file system or network from SQL: `read_csv('/etc/passwd')` inside a predicate is refused.
    return duckdb.connect(config={"enable_external_access": False, "lock_configuration": True})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def select_rows(table, predicate: str):
    """The rows of ``table`` for which the SQL ``predicate`` is true, in stored order, same schema.

    The predicate sees every trajectory column (and may use subqueries over the table ``trajectories``,
    e.g. ``group_id IN (SELECT group_id FROM trajectories GROUP BY 1 HAVING avg(reward) > 0)``).
    """
    if not predicate or not predicate.strip():
        raise QueryError("--where needs a predicate, e.g. \"outcome = 'success' OR len(completion_token_ids) <= 4\"")
    indexed = table.append_column(_ROW, pa.array(range(table.num_rows), pa.int64()))
    con = _connect()
    try:
        con.register(TABLE, indexed)
        picked = con.table(TABLE).filter(predicate).order(_ROW).project(_ROW).fetch_arrow_table()
    except duckdb.Error as exc:
        raise QueryError(f"invalid --where predicate {predicate!r}: {_first_line(exc)}") from None
    finally:
        con.close()
    return table.take(picked.column(_ROW))


def _query(con, sql: str) -> list[tuple]:
    return con.sql(sql).fetchall()


def summarize(table) -> dict[str, Any]:
    """Counts and distributions of one version: rows and groups, rewards and outcomes, filter
    decisions, completion lengths, and the policy versions that produced its tokens."""
    con = _connect()
    try:
        con.register(TABLE, table)
        (
            rows,
            groups,
            prompts,
            kept_rows,
            kept_groups,
            reward_mean,
            reward_min,
            reward_max,
            unscored,
            adv_mean,
            adv_abs,
        ) = _query(
            con,
            f"""
            SELECT count(*), count(DISTINCT group_id), count(DISTINCT prompt_id),
                   count(*) FILTER (kept), count(DISTINCT group_id) FILTER (kept),
                   avg(reward), min(reward), max(reward), count(*) FILTER (reward IS NULL),
                   avg(advantage) FILTER (kept), avg(abs(advantage)) FILTER (kept)
            FROM {TABLE}""",
        )[0]
        lengths = _query(
            con,
            f"""
            SELECT min(n), quantile_disc(n, 0.5), quantile_disc(n, 0.9), quantile_disc(n, 0.99), max(n), avg(n)
            FROM (SELECT len(completion_token_ids) AS n FROM {TABLE})""",
        )[0]

        def counts(column: str, where: str = "true") -> dict[str, int]:
            found = _query(
                con,
                f"SELECT coalesce({column}::VARCHAR, 'none'), count(*) FROM {TABLE} WHERE {where} "
                "GROUP BY 1 ORDER BY 2 DESC, 1",
            )
            return {str(k): int(v) for k, v in found}

        policy_versions = _query(
            con,
            f"""
            SELECT v, count(*) FROM (SELECT unnest(token_policy_versions) AS v FROM {TABLE}) GROUP BY 1 ORDER BY 1""",
        )
        rewards = _query(
            con, f"SELECT reward, count(*) FROM {TABLE} WHERE reward IS NOT NULL GROUP BY 1 ORDER BY 1 LIMIT 11"
        )
        return {
            "rows": rows,
            "groups": groups,
            "prompts": prompts,
            "kept_rows": kept_rows,
            "kept_groups": kept_groups,
            "schema_versions": sorted(counts("schema_version")),
            "columns": table.schema.names,
            "runs_rounds": [
                f"{r}/{k}" for r, k in _query(con, f"SELECT DISTINCT run_id, round FROM {TABLE} ORDER BY 1, 2")
            ],
            "reward": {
                "mean": reward_mean,
                "min": reward_min,
                "max": reward_max,
                "unscored": unscored,
                # a handful of distinct values (verifiable rewards): show them all; else it is continuous
                "values": {str(r): int(n) for r, n in rewards} if len(rewards) <= 10 else None,
            },
            "advantage": {"kept_mean": adv_mean, "kept_mean_abs": adv_abs},
            "outcome": counts("outcome"),
            "drop_reason": counts("drop_reason", where="kept IS NOT TRUE"),
            "finish_reason": counts("finish_reason"),
            "completion_tokens": dict(zip(("min", "p50", "p90", "p99", "max", "mean"), lengths)),
            "policy_versions": {int(v): int(n) for v, n in policy_versions},
        }
    finally:
        con.close()


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def export_table(table, fmt: str, path: str) -> int:
    """Write ``table`` to ``path`` (a local path or any fsspec URI) as one JSONL or Parquet file."""
    if fmt not in EXPORT_FORMATS:
        raise QueryError(f"unknown export format {fmt!r}; use one of {', '.join(EXPORT_FORMATS)}")
    fs = filesystem_for(path)
    try:
        with fs.open(path, "wb") as f:
            if fmt == "parquet":
                pq.write_table(table, f, compression="zstd")
            else:
                for batch in table.to_batches(max_chunksize=4096):
                    f.write(
                        "".join(json.dumps(row, default=_json_default) + "\n" for row in batch.to_pylist()).encode()
                    )
    except (OSError, PermissionError) as exc:
        raise QueryError(
            f"cannot write {path}: {getattr(exc, 'strerror', None) or exc}; pass a writable path"
        ) from None
    return table.num_rows
