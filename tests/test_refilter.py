"""Re-filtering with SQL (DuckDB) into derived versions, and browsing versions from the command line.

Fast: synthetic versions written through the real store. One test re-filters a real round's version
(the shared tiny campaign) and is marked slow.
"""

import json
import os

import pyarrow.parquet as pq
import pytest
from test_store import make_row

from flows.cli import main
from storage.paths import StorageRoot
from storage.query import QueryError, select_rows
from storage.trajectories import (
    CorruptPartError,
    find_version,
    list_manifests,
    read_table,
    rows_to_table,
    write_version,
)
from tasks.config.filter import FilterConfig
from tasks.config.refilter import RefilterRequest
from tasks.filter.refilter import run_refilter
from tasks.filter.stage import DROP_ZERO_VARIANCE

# Four groups of four samples. Rewards per group:
#   g0: 1 0 1 0   g1: 1 1 1 0   g2: 0 0 0 1   g3: 1 1 1 1 (zero variance)
# Completion lengths are sample_index + 1 tokens, so "length <= 3" drops sample 3 of every group.
REWARDS = {0: [1, 0, 1, 0], 1: [1, 1, 1, 0], 2: [0, 0, 0, 1], 3: [1, 1, 1, 1]}


def _rows() -> list[dict]:
    rows = []
    for group, rewards in REWARDS.items():
        for index, reward in enumerate(rewards):
            row = make_row(group, index, float(reward))
            row.update(
                completion_token_ids=[7] * (index + 1),
                rollout_logprobs=[-0.5] * (index + 1),
                token_policy_versions=[group % 2] * (index + 1),
                kept=group != 3,
                advantage=0.25 * index,
                drop_reason=DROP_ZERO_VARIANCE if group == 3 else None,
            )
            rows.append(row)
    return rows


@pytest.fixture
def store(tmp_path):
    root = StorageRoot.of(str(tmp_path / "store"))
    meta = {
        "kind": "rollout",
        "run_id": "run",
        "round": 1,
        "parent": None,
        "derivation": {"filter": FilterConfig().model_dump(mode="json"), "target_groups": 3, "policy_version": 0},
    }
    manifest = write_version(root, lambda v: root.trajectory_version("run", 1, v), rows_to_table(_rows()), meta)
    return root, manifest


def test_select_rows_keeps_order_and_schema(store):
    root, manifest = store
    table = read_table(root, manifest)
    picked = select_rows(table, "len(completion_token_ids) <= 3 AND group_id <> 'g1'")
    assert picked.schema == table.schema
    assert [(r["group_id"], r["sample_index"]) for r in picked.to_pylist()] == [
        (f"g{g}", i) for g in (0, 2, 3) for i in range(3)
    ]
    # group-level predicates through a subquery over the same rows
    mixed = select_rows(
        table, "group_id IN (SELECT group_id FROM trajectories GROUP BY 1 HAVING min(reward) < max(reward))"
    )
    assert sorted({r["group_id"] for r in mixed.to_pylist()}) == ["g0", "g1", "g2"]


@pytest.mark.parametrize(
    "predicate, message",
    [
        ("reward >", "Parser Error"),  # not an expression
        ("nosuch = 1", 'column "nosuch" not found'),  # unknown column
        ("prompt_text", "Could not convert"),  # not a boolean
        ("true) UNION SELECT 99 --", "Parser Error"),  # cannot escape the expression
        ("reward > 0; DROP TABLE trajectories", "Parser Error"),  # one expression, no second statement
        ("EXISTS (SELECT * FROM read_csv('/etc/passwd'))", "Permission Error"),  # no file access from SQL
        ("   ", "needs a predicate"),  # empty
    ],
)
def test_bad_predicates_are_one_line_errors(store, predicate, message):
    root, manifest = store
    with pytest.raises(QueryError, match=message) as info:
        select_rows(read_table(root, manifest), predicate)
    assert "\n" not in str(info.value)


def test_refilter_commits_idempotent_derived_version_recording_parent_and_predicate(store):
    root, manifest = store
    where = "len(completion_token_ids) <= 3"
    first = run_refilter(storage=root.uri, request=RefilterRequest(version=manifest.version[:8], where=where))
    again = run_refilter(storage=root.uri, request=RefilterRequest(version=manifest.version, where=where))
    other = run_refilter(
        storage=root.uri, request=RefilterRequest(version=manifest.version, where="len(completion_token_ids) <= 2")
    )
    assert first.version == again.version != other.version
    assert first.uri == root.derived_version(first.version)
    derived = find_version(root, first.version)
    assert derived.parent == manifest.version and derived.kind == "derived"
    assert derived.derivation["where"] == where and derived.derivation["regroup"] is False
    rows = read_table(root, derived).to_pylist()
    # without regrouping rows keep the round's decisions
    assert len(rows) == 12 and [r["advantage"] for r in rows[:3]] == [0.0, 0.25, 0.5]
    assert {r["trajectory_version"] for r in rows} == {derived.version}
    assert sorted(m.version for m in list_manifests(root)) == sorted([manifest.version, first.version, other.version])


def test_regroup_recomputes_advantages_and_drops_groups_left_without_signal(store):
    root, manifest = store
    result = run_refilter(
        storage=root.uri,
        request=RefilterRequest(version=manifest.version, where="len(completion_token_ids) <= 3", regroup=True),
    )
    derived = find_version(root, result.version)
    assert derived.derivation["filter"] == FilterConfig().model_dump(mode="json")  # the round's recorded rules
    by_group = {}
    for row in read_table(root, derived).to_pylist():
        by_group.setdefault(row["group_id"], []).append(row)
    # g1 kept 1 1 1 and g2 kept 0 0 0: no signal left; g0 kept 1 0 1: still mixed, new advantages
    assert {g: rows[0]["drop_reason"] for g, rows in by_group.items()} == {
        "g0": None,
        "g1": DROP_ZERO_VARIANCE,
        "g2": DROP_ZERO_VARIANCE,
        "g3": DROP_ZERO_VARIANCE,
    }
    g0 = [r["advantage"] for r in by_group["g0"]]
    assert g0[0] == g0[2] > 0 > g0[1] and abs(sum(g0)) < 1e-9
    assert result.stats["filter/kept_groups"] == 1


def test_corrupted_parent_is_refused_before_any_sql(store):
    root, manifest = store
    part = os.path.join(manifest.directory, "part-00000.parquet")
    data = bytearray(open(part, "rb").read())
    data[100] ^= 0x01
    open(part, "wb").write(bytes(data))
    with pytest.raises(CorruptPartError, match=rf"{manifest.version}.*part-00000.parquet.*corrupted"):
        run_refilter(storage=root.uri, request=RefilterRequest(version=manifest.version, where="true"))


def test_cli_list_show_export_and_refilter(store, tmp_path, capsys):
    root, manifest = store
    assert (
        main(["refilter", manifest.version, "--where", "outcome = 'success'", "--regroup", "--storage", root.uri]) == 0
    )
    derived_version = capsys.readouterr().out.split()[2]
    assert main(["trajectories", "list", "--storage", root.uri]) == 0
    listing = capsys.readouterr().out
    assert manifest.version in listing and f"{derived_version}  derived" in listing
    assert main(["trajectories", "list", "--run", "other", "--storage", root.uri]) == 0
    assert "no committed trajectory versions of run other" in capsys.readouterr().out

    assert main(["trajectories", "show", manifest.version, "--storage", root.uri]) == 0
    shown = capsys.readouterr().out
    for expected in (
        "rows             16 in 4 groups",
        "values 0.0 6, 1.0 10",
        "outcomes         success 10, model_failure 6",
        "dropped          zero_variance_group 4",
        "completion len   min 1, p50 2",
        "policy versions  0 (20 tokens), 1 (20 tokens)",
    ):
        assert expected in shown, expected
    assert main(["trajectories", "show", derived_version, "--json", "--storage", root.uri]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [c["version"] for c in summary["parent_chain"]] == [derived_version, manifest.version]
    assert summary["parent_chain"][0]["where"] == "outcome = 'success'"

    jsonl, parquet = tmp_path / "out.jsonl", tmp_path / "out.parquet"
    assert (
        main(["trajectories", "export", manifest.version, "--format", "jsonl", str(jsonl), "--storage", root.uri]) == 0
    )
    assert (
        main(["trajectories", "export", manifest.version, "--format", "parquet", str(parquet), "--storage", root.uri])
        == 0
    )
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert (
        len(lines) == 16
        and lines[0]["completion_token_ids"] == [7]
        and lines[0]["enqueued_at"].startswith("2026-01-01")
    )
    assert pq.read_table(parquet).num_rows == 16


@pytest.mark.parametrize(
    "argv, message",
    [
        (["refilter", "{v}", "--where", "reward >"], "invalid --where predicate 'reward >': Parser Error"),
        (["refilter", "00000000", "--where", "true"], "no committed trajectory version '00000000'"),
        (["trajectories", "show", "xyz"], "must be at least 6 hex characters"),
        (["refilter", "{v}", "--where", "true", "--target-groups", "2"], "--target-groups needs --regroup"),
    ],
)
def test_cli_user_errors_are_one_line(store, capsys, argv, message):
    root, manifest = store
    assert main([a.format(v=manifest.version) for a in argv] + ["--storage", root.uri]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.slow
def test_refilter_flow_on_a_real_round(tiny_campaign):
    from flows.replay import rl_refilter

    storage = tiny_campaign["storage"]
    version = tiny_campaign["result"]["rounds"][1]["trajectory_version"]
    request = RefilterRequest(
        version=version, where="finish_reason = 'stop' AND len(completion_token_ids) <= 3", regroup=True
    )
    result = rl_refilter(request, storage=storage)  # the Prefect flow behind the `refilter` deployment
    assert run_refilter(storage=storage, request=request).version == result.version  # idempotent on real data too
    rows = read_table(StorageRoot.of(storage), find_version(StorageRoot.of(storage), result.version)).to_pylist()
    assert rows and all(len(r["completion_token_ids"]) <= 3 for r in rows)
    for group in {r["group_id"] for r in rows if r["kept"]}:
        members = [r for r in rows if r["group_id"] == group and r["kept"]]
        assert len({r["reward"] for r in members}) > 1 and abs(sum(r["advantage"] for r in members)) < 1e-6
