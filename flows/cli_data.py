"""``rlrounds`` commands over what rounds leave behind: trajectories (list, show, export), refilter,
reverify, replay, lineage, gc, and the tracking server over a root's MLflow store. ``add_commands``
registers them on the main parser (flows/cli.py).

The modules that import pyarrow, DuckDB, MLflow or Prefect are imported by the command that uses them,
so ``rlrounds --help`` stays instant. Read-only commands never create anything under the root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pydantic import ValidationError

from flows.config import ConfigError, ReplayRequest, load_campaign_config
from flows.errors import UserError
from storage.gc import DEFAULT_GRACE_S, collect
from storage.model_versions import parse_model_version
from storage.paths import StorageRoot
from storage.settings import settings
from tasks.config.refilter import REVERIFY_DEFAULT_WHERE, RefilterRequest, ReverifyRequest
from tasks.config.verify import VerifyConfig


def add_commands(sub) -> None:
    trajectories = sub.add_parser("trajectories", help="list, inspect and export committed trajectory versions")
    tsub = trajectories.add_subparsers(dest="trajectories_command", required=True)
    with storage_command(tsub, "list", cmd_list, "every committed trajectory version under the storage root") as c:
        c.add_argument("--run", help="only versions of this campaign run id")
    with storage_command(
        tsub, "show", cmd_show, "schema, counts, rewards, outcomes, lengths, policy versions and parents of a version"
    ) as c:
        version_arg(c)
        c.add_argument("--json", action="store_true", help="print the summary as JSON")
        c.add_argument(
            "--episodes",
            type=int,
            default=1,
            metavar="N",
            help="an agentic round's version: print its first N episodes turn by turn (default 1; 0: none)",
        )
    with storage_command(tsub, "export", cmd_export, "write a version's rows to one JSONL or Parquet file") as c:
        version_arg(c)
        c.add_argument("path", help="output file (a local path or an fsspec URI)")
        c.add_argument("--format", required=True, choices=["jsonl", "parquet"], help="output format")

    with storage_command(
        sub, "refilter", cmd_refilter, "select rows of a version with SQL (DuckDB) into a derived version"
    ) as c:
        version_arg(c)
        c.add_argument(
            "--where",
            required=True,
            help="SQL predicate over trajectory columns, e.g. "
            "\"len(completion_token_ids) <= 4 AND outcome = 'success'\"",
        )
        c.add_argument(
            "--regroup",
            action="store_true",
            help="recompute advantages within the remaining groups and re-drop zero-variance groups",
        )
        c.add_argument("--target-groups", type=int, help="with --regroup: keep only the first N trainable groups")

    with storage_command(
        sub, "reverify", cmd_reverify, "verify selected rows of a version again into a derived version"
    ) as c:
        version_arg(c)
        c.add_argument(
            "--where",
            default=None,
            help="SQL predicate choosing the rows to verify again (default: \"outcome = 'infra_failure'\")",
        )
        c.add_argument("--verifier", help="verifier name (default: the one recorded on the rows)")

    with storage_command(
        sub, "replay", cmd_replay, "train on a stored trajectory version from a registered model version"
    ) as c:
        c.add_argument("--trajectories", required=True, help="trajectory version id or unique prefix")
        c.add_argument("--from-model", required=True, help="registered model version to start from, NAME/VERSION")
        c.add_argument(
            "--config",
            help="campaign config file the round ran with (default: the training config recorded with the round)",
        )
        c.add_argument("--model-name", help="registered model name for the result (default: the parent's)")
        c.add_argument("--no-evaluate", action="store_true", help="skip the held-out evaluation of the result")

    with storage_command(sub, "lineage", cmd_lineage, "walk a model version's parents back to the base policy") as c:
        model_version_arg(c)
        c.add_argument("--json", action="store_true", help="print the steps as JSON")

    with storage_command(
        sub,
        "tracking-server",
        cmd_tracking_server,
        "serve the storage root's MLflow store over HTTP, for rounds on many processes or hosts "
        "(they set RLROUNDS_MLFLOW_URI to its address)",
    ) as c:
        c.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0 for other hosts)")
        c.add_argument("--port", type=int, default=5000, help="port to listen on (default 5000)")
        c.add_argument("--workers", type=int, default=2, help="server worker processes (default 2)")

    with storage_command(
        sub, "gc", cmd_gc, "remove uncommitted leftovers (never a committed version or checkpoint)"
    ) as c:
        c.add_argument(
            "--grace",
            type=float,
            default=DEFAULT_GRACE_S,
            help=f"only leftovers untouched for this many seconds (default {DEFAULT_GRACE_S:.0f}: a day)",
        )
        c.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")


# Arguments several commands take (here and in flows/cli.py), declared once so they read the same everywhere.
STORAGE_HELP = "storage root: a directory or s3://bucket/prefix (default $RLROUNDS_STORAGE or ./rlrounds-data)"


@contextmanager
def storage_command(
    sub, name: str, func: Callable[[argparse.Namespace], int], help: str
) -> Iterator[argparse.ArgumentParser]:
    """A command over a storage root: the block adds its own arguments, then --storage comes last."""
    parser = sub.add_parser(name, help=help)
    yield parser
    storage_arg(parser)
    parser.set_defaults(func=func)


def storage_arg(parser: argparse.ArgumentParser, help: str = STORAGE_HELP) -> None:
    parser.add_argument("--storage", help=help)


def version_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("version", help="version id or a unique prefix (6+ characters)")


def model_version_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_version", help="registered model version, NAME/VERSION")


def _root(args: argparse.Namespace):
    """The storage root to read; a local one must exist (read commands never create one)."""
    uri = args.storage or settings().storage
    root = StorageRoot.of(uri)
    if root.is_local and not os.path.isdir(root.uri):
        raise UserError(
            f"storage root {uri} does not exist; pass --storage or set RLROUNDS_STORAGE to where the rounds ran"
        )
    return root


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _counts(counts: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


# -- trajectories -----------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace) -> int:
    from storage.trajectories import list_manifests

    manifests = [m for m in list_manifests(_root(args)) if args.run is None or m.body.get("run_id") == args.run]
    manifests.sort(key=lambda m: (str(m.body.get("run_id")), m.body.get("round") or 0, m.parent is not None, m.version))
    print(f"{'VERSION':<22}{'KIND':<9}{'RUN':<28}{'ROUND':>6}{'ROWS':>9}  PARENT")
    for m in manifests:
        print(
            f"{m.version:<22}{m.kind:<9}{str(m.body.get('run_id')):<28}{str(m.body.get('round')):>6}{m.rows:>9}  "
            f"{m.parent or '-'}"
        )
    if not manifests:
        print(
            "(no committed trajectory versions)"
            if args.run is None
            else f"(no committed trajectory versions of run {args.run})"
        )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from storage.lineage import derivation_of, describe_derivation
    from storage.query import summarize
    from storage.trajectories import find_version, read_table

    root = _root(args)
    manifest = find_version(root, args.version)
    table = read_table(root, manifest)
    summary = summarize(table)
    chain = derivation_of(root, manifest.version)
    if args.json:
        print(
            json.dumps(
                {
                    "version": manifest.version,
                    "uri": manifest.directory,
                    "manifest": manifest.body,
                    "summary": summary,
                    "parent_chain": chain,
                },
                indent=2,
                default=str,
            )
        )
        return 0
    s, reward, lengths = summary, summary["reward"], summary["completion_tokens"]
    values = f"; values {_counts(reward['values'])}" if reward["values"] else ""

    def fmt(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    lines = [
        f"trajectory version {manifest.version} ({manifest.kind}, run {manifest.body.get('run_id')} round "
        f"{manifest.body.get('round')})",
        f"  location         {manifest.directory}",
        f"  schema           {manifest.body.get('schema_version')}, {len(s['columns'])} columns; "
        f"{len(manifest.parts)} part(s), "
        f"{_size(sum(p.get('bytes', 0) for p in manifest.parts))}",
        f"  rows             {s['rows']} in {s['groups']} groups ({s['prompts']} prompts); kept {s['kept_rows']} "
        f"rows in {s['kept_groups']} groups",
        f"  reward           mean {fmt(reward['mean'])}, min {fmt(reward['min'])}, max {fmt(reward['max'])}, "
        f"unscored {reward['unscored']}{values}",
        f"  advantage        kept mean {fmt(s['advantage']['kept_mean'])}, mean |a| "
        f"{fmt(s['advantage']['kept_mean_abs'])}",
        f"  outcomes         {_counts(s['outcome'])}",
        f"  dropped          {_counts(s['drop_reason'])}",
        f"  finish reasons   {_counts(s['finish_reason'])}",
        f"  completion len   min {lengths['min']}, p50 {lengths['p50']}, p90 {lengths['p90']}, p99 {lengths['p99']}, "
        f"max {lengths['max']}, mean {fmt(lengths['mean'], '.2f')} tokens",
        f"  policy versions  {', '.join(_version(v, n) for v, n in s['policy_versions'].items()) or 'none'}",
        f"  derivation       {json.dumps(manifest.derivation, sort_keys=True)}",
        f"  parent chain     {describe_derivation(chain)}",
    ]
    episodes = _episodes(table, args.episodes)
    print("\n".join(lines + episodes))
    return 0


def _version(version, tokens: int) -> str:
    """'3 (120 tokens)'; an episode's observation tokens, which no policy sampled, as 'observations (40 tokens)'."""
    return f"observations ({tokens} tokens)" if str(version) == "-1" else f"{version} ({tokens} tokens)"


def _episodes(table, count: int) -> list[str]:
    """The first ``count`` episodes of a version whose rows are multi-turn episodes, turn by turn (none otherwise)."""
    from tasks.rollout.episodes import describe_episode_row

    with_turns = table.filter(table.column("turns").is_valid())
    if count <= 0 or with_turns.num_rows == 0:
        return []
    turns = [len(t) for t in with_turns.column("turns").to_pylist()]
    lines = [f"  episodes         {with_turns.num_rows} rows are episodes; turns mean {sum(turns) / len(turns):.2f}, "
             f"max {max(turns)}"]  # fmt: skip
    return lines + [describe_episode_row(row) for row in with_turns.slice(0, count).to_pylist()]


def cmd_export(args: argparse.Namespace) -> int:
    from storage.query import export_table
    from storage.trajectories import find_version, read_table

    root = _root(args)
    manifest = find_version(root, args.version)
    path = args.path if "://" in args.path else os.path.abspath(args.path)
    rows = export_table(read_table(root, manifest), args.format, path)
    print(f"exported {rows} rows of trajectory version {manifest.version} to {path} ({args.format})")
    return 0


# -- refilter, replay ---------------------------------------------------------------------------------


def cmd_refilter(args: argparse.Namespace) -> int:
    from tasks.filter.refilter import run_refilter

    if args.target_groups is not None and (not args.regroup or args.target_groups < 1):
        raise UserError("--target-groups needs --regroup and a positive number of groups")
    root = _root(args)
    request = RefilterRequest(
        version=args.version, where=args.where, regroup=args.regroup, target_groups=args.target_groups
    )
    result = run_refilter(storage=root.uri, request=request)
    s = result.stats
    print(
        f"derived version {result.version} from {result.parent}: {s['filter/rows']:.0f} rows, kept "
        f"{s['filter/kept_rows']:.0f} "
        f"in {s['filter/kept_groups']:.0f} groups{' (regrouped)' if args.regroup else ''} -> {result.uri}"
    )
    return 0


def cmd_reverify(args: argparse.Namespace) -> int:
    from tasks.filter.refilter import run_reverify

    root = _root(args)
    request = ReverifyRequest(
        version=args.version, where=args.where or REVERIFY_DEFAULT_WHERE, verify=VerifyConfig(verifier=args.verifier)
    )
    try:
        result = run_reverify(storage=root.uri, request=request)
    except ValueError as exc:  # no such verifier, several recorded
        raise UserError(str(exc)) from None
    s, v = result.stats, result.verifier
    print(
        f"derived version {result.version} from {result.parent}: {result.rows} rows verified again with "
        f"{v['name']} v{v['version']} ({_counts(result.outcomes_before)} -> {_counts(result.outcomes_after)}); "
        f"kept {s['filter/kept_rows']:.0f} rows in {s['filter/kept_groups']:.0f} groups -> {result.uri}"
    )
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from flows.replay import rl_replay

    config = None
    if args.config:
        try:
            config = load_campaign_config(args.config).round
        except ConfigError as exc:
            raise UserError(str(exc)) from None
    root = _root(args)

    try:
        request = ReplayRequest(
            trajectories=args.trajectories,
            from_model=args.from_model,
            config=config,
            model_name=args.model_name,
            evaluate=not args.no_evaluate,
        )
    except ValidationError as exc:
        raise UserError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None
    result = rl_replay(request, storage=root.uri)
    accuracy = result["accuracy"]
    evaluated = f", held-out accuracy {accuracy:.1%}" if accuracy is not None else ""
    print(
        f"{result['replay_id']}: {result['from_model']} + trajectories {result['trajectory_version']} -> "
        f"{result['model_version']}{evaluated}; checkpoint {result['checkpoint']}"
    )
    return 0


# -- lineage, gc ------------------------------------------------------------------------------------


def cmd_lineage(args: argparse.Namespace) -> int:
    from storage.lineage import format_lineage, to_json, walk
    from storage.tracking import Tracker

    parse_model_version(args.model_version)  # a malformed reference fails before MLflow is touched
    root = _root(args)
    steps = walk(Tracker.connect(settings(), root, must_exist=True), root, args.model_version)
    if args.json:
        print(json.dumps(to_json(steps), indent=2))
    else:
        sys.stdout.write(format_lineage(steps))
    return 0


def cmd_tracking_server(args: argparse.Namespace) -> int:
    """Open (create, migrate) the root's MLflow store under its lock, then become ``mlflow server`` on it."""
    from storage.tracking import Tracker, server_command

    if args.workers < 1 or not 0 < args.port < 65536:
        raise UserError("--workers must be 1 or more and --port a port number (1-65535)")
    root = StorageRoot.of(args.storage or settings().storage)
    if root.is_local:
        os.makedirs(root.uri, exist_ok=True)
    local = settings().model_copy(update={"mlflow_uri": None})  # the store itself, not a server in front of it
    Tracker.connect(local, root)
    command = server_command(local, root, args.host, args.port, args.workers)
    print(
        f"rlrounds: MLflow tracking server for {root.uri} on http://{args.host}:{args.port}; rounds use it with "
        f"RLROUNDS_MLFLOW_URI=http://{args.host}:{args.port}",
        flush=True,
    )
    os.execv(command[0], command)
    return 0  # not reached: the process is the server now


def cmd_gc(args: argparse.Namespace) -> int:
    if args.grace < 0:
        raise UserError("--grace must be zero or more seconds")
    root = _root(args)
    leftovers = collect(root, grace_s=args.grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for item in leftovers:
        print(
            f"{verb} {item.kind:<12} {item.path}  ({item.files} files, {_size(item.bytes)}, {item.age_s / 3600:.1f} "
            "h old)"
        )
    total = sum(item.bytes for item in leftovers)
    print(
        f"gc: {verb} {len(leftovers)} uncommitted leftover(s), {_size(total)}; committed versions and checkpoints "
        "untouched"
    )
    return 0
