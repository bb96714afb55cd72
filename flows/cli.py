"""The ``rlrounds`` command line. The modules that import torch, Prefect or MLflow are imported by the
command that runs them, so ``rlrounds --help`` and ``rlrounds config`` answer at once.

Errors the user can fix end in one line naming the problem and the fix (exit 2); ``--debug`` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import warnings

from pydantic import ValidationError

from flows.cli_data import add_commands, model_version_arg, storage_arg
from flows.config import CampaignConfig, ConfigError, commented_yaml, describe_validation_error, load_campaign_config
from flows.errors import UserError
from flows.orphans import stop_children, take_over
from storage.campaigns import claim, stored_config
from storage.files import probe_writable
from storage.paths import StorageRoot
from storage.settings import settings

EXIT_USAGE = 2
# CampaignConfig.rounds' default, repeated so `--help` needs no config import; tests/test_install.py keeps them equal.
DEFAULT_ROUNDS = 45


def quiet_libraries(debug: bool) -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "DEBUG" if debug else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # mlflow sets its own loggers' level when it is imported (after this), from this variable
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "DEBUG" if debug else "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.getLogger("mlflow").setLevel(logging.DEBUG if debug else logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.DEBUG if debug else logging.WARNING)

    if not debug:
        warnings.filterwarnings("ignore")


class _ProgressHandler(logging.Handler):
    """Stage progress: rewritten in place on a terminal, throttled lines otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if self.tty:
            sys.stderr.write("\r\033[K" + msg[:150])
            sys.stderr.flush()
        elif time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            sys.stderr.write(f"  ... {msg}\n")


class _LineHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K")
        sys.stdout.write(record.getMessage() + "\n")
        sys.stdout.flush()


def _setup_logging() -> None:
    main = logging.getLogger("rlrounds")
    main.setLevel(logging.INFO)
    main.propagate = False
    main.handlers = [_LineHandler()]
    progress = logging.getLogger("rlrounds.progress")
    progress.propagate = False
    progress.handlers = [_ProgressHandler()]


def check_storage_writable(uri: str) -> None:
    """Fail before anything is written if the storage root cannot take files."""
    root = StorageRoot.of(uri)
    try:
        probe_writable(root)
    except Exception as exc:  # noqa: BLE001 -- any failure means the root is unusable
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(
            f"storage root {uri} is not writable ({reason}); pass --storage with a writable directory or s3:// URI"
        ) from None


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume and args.run_id:
        raise UserError("--run-id starts a campaign and --resume RUN_ID continues one; pass only one of them")
    storage = args.storage or _settings_storage()
    try:
        if args.resume:
            config = _resume_config(args.resume, args.config, args.rounds, storage, args.preset)
        else:
            config = load_campaign_config(args.config, args.preset, rounds=args.rounds, run_id=args.run_id)
        config = _with_rollout(config, replicas=args.replicas, ray_address=args.ray_address)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    check_storage_writable(storage)
    os.environ["RLROUNDS_STORAGE"] = storage
    _check_before_starting(config, storage, resume=bool(args.resume), takeover=args.takeover)
    from flows.campaign import rl_campaign

    what = f"resuming campaign {config.run_id}" if args.resume else "campaign"
    print(f"rlrounds: {what} of {config.rounds} rounds, storage {storage}", flush=True)
    start = time.perf_counter()
    result = rl_campaign(config, storage=storage, resume=bool(args.resume), takeover=args.takeover)
    rounds = result["rounds"]
    minutes = (time.perf_counter() - start) / 60
    print(
        f"campaign {result['run_id']}: held-out accuracy {rounds[0]['accuracy']:.1%} -> {rounds[-1]['accuracy']:.1%} "
        f"in {len(rounds) - 1} rounds, {minutes:.1f} min; final model {result['final_model_version']}",
        flush=True,
    )
    return 0


def _resume_config(run_id: str, path: str | None, rounds: int | None, storage: str, preset: str | None = None):
    """The config to resume with: the stored one, or --preset/--config (which the flow checks against it)."""
    if path or preset:
        return load_campaign_config(path, preset, rounds=rounds, run_id=run_id)
    data = {**stored_config(StorageRoot.of(storage), run_id), "run_id": run_id}
    if rounds is not None:
        data["rounds"] = rounds
    try:
        return CampaignConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            f"the stored config of campaign {run_id} no longer validates ({describe_validation_error(exc, None)}); "
            "pass --config with the equivalent config for this version"
        ) from None


def _check_before_starting(config, storage: str, resume: bool, takeover: bool) -> None:
    """Every input and ownership check the flow makes first, made here before Prefect starts, so a
    problem costs a second and ends in one line with nothing written. The flow repeats them (cheap)."""
    from tasks.campaign.preflight import run_preflight

    if config.run_id:
        claim(
            StorageRoot.of(storage),
            config.run_id,
            config.model_dump(mode="json"),
            config.identity(),
            "resume" if resume else "new",
            takeover,
            dry_run=True,
        )
    run_preflight(config=config.round, storage=storage)


def _settings_storage() -> str:
    return settings().storage


def _with_rollout(config, **fields):
    """``run --replicas/--ray-address`` applied to round.rollout, validated like a config file's values."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if not fields:
        return config
    data = config.model_dump(mode="json")
    data["round"]["rollout"].update(fields)
    try:
        return CampaignConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, None)) from None


def cmd_eval(args: argparse.Namespace) -> int:
    """Score a registered model version at a serving engine/dtype and at training precision."""
    try:
        config = load_campaign_config(args.config)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    storage = args.storage or _settings_storage()
    if "://" not in storage and not os.path.isdir(storage):
        raise UserError(
            f"storage root {storage} does not exist; pass --storage or set RLROUNDS_STORAGE to where the rounds ran"
        )
    os.environ["RLROUNDS_STORAGE"] = storage
    from flows.evaluate import rl_evaluate

    result = rl_evaluate(args.model_version, config.round, args.engine, args.dtype, storage)
    print(
        f"{result.model_version}: held-out accuracy {result.accuracy:.1%} on {result.engine} {result.dtype}, "
        f"{result.accuracy_train_precision:.1%} at training precision ({result.train_dtype}), "
        f"gap {result.serving_gap:+.1%} over {result.prompts} prompts",
        flush=True,
    )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    try:
        config = load_campaign_config(None, args.preset)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    print(commented_yaml(config), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlrounds", description="RL post-training of language models as auditable rounds."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a campaign of RL rounds")
    run.add_argument("--rounds", type=int, help=f"number of rounds (default: the config's, {DEFAULT_ROUNDS})")
    run.add_argument(
        "--config", help="YAML or JSON campaign config (see `rlrounds config`); with --preset, laid over the preset"
    )
    run.add_argument(
        "--preset",
        help="start from a config shipped with rlrounds, e.g. long-tail (see `rlrounds config --preset NAME`)",
    )
    storage_arg(run)
    run.add_argument("--run-id", help="campaign id (default: a fresh one)")
    run.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue a stopped or killed campaign from its last committed stage "
        "(its stored config unless --config is given, which must match; --rounds may extend it)",
    )
    run.add_argument(
        "--takeover",
        action="store_true",
        help="with --resume: take over although the recorded owner runs on another host (make sure it is gone)",
    )
    run.add_argument(
        "--replicas", type=int, help="rollout engine replicas as Ray actors (default: the config's rollout.replicas, 1)"
    )
    run.add_argument(
        "--ray-address", help="Ray cluster for the replicas, e.g. auto or ray://host:10001 (default: a local Ray)"
    )
    run.set_defaults(func=cmd_run)

    evaluate = sub.add_parser(
        "eval", help="score a model version at a serving engine/precision and at training precision"
    )
    model_version_arg(evaluate)
    evaluate.add_argument(
        "--engine", choices=["embedded", "vllm"], help="serving engine (default: the config's evaluate.serving_engine)"
    )
    evaluate.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="serving precision (default: evaluate.serving_dtype)",
    )
    evaluate.add_argument("--config", help="campaign config whose evaluate, prompts and verify sections apply")
    storage_arg(evaluate, help="storage root the rounds ran on (default $RLROUNDS_STORAGE or ./rlrounds-data)")
    evaluate.set_defaults(func=cmd_eval)

    config = sub.add_parser(
        "config", help="print the default campaign config (or a preset's) as YAML, each field's help as a comment"
    )
    config.add_argument("--preset", help="print this preset's full config instead, e.g. long-tail")
    config.set_defaults(func=cmd_config)
    add_commands(sub)  # trajectories, refilter, replay, lineage, gc (flows/cli_data.py)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that a stopped command unwinds as on Ctrl-C: engines and
    verifier pools are released by the code that opened them, Prefect stops its server at exit."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet_libraries(args.debug)
    _setup_logging()

    take_over("rlrounds")  # what campaigns killed before they could stop their children left behind
    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python runs handlers
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _run(args)
    except Terminated:
        stopped = stop_children()  # whatever is still running of what this command started
        print(f"terminated; stopped {len(stopped)} process(es) it had started", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Terminated:
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one line for known input problems, traceback on --debug
        message = _known_input_error(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE


KNOWN_INPUT_ERRORS = frozenset(
    {
        "models.checkpoint.PolicyLoadError",
        "models.device.DeviceError",
        "tasks.prompts.sources.PromptError",
        "models.prompt.ChatTemplateError",
        "storage.campaigns.CampaignError",
        "tasks.verifiers.pool.InfraFailureRateError",
        "storage.model_versions.LineageError",  # includes storage.lineage.AuditError, tasks.campaign.replay.ReplayError
        "storage.trajectories.TrajectoryStoreError",  # includes CorruptPartError
        "storage.query.QueryError",
        "storage.checkpoints.CheckpointError",
    }
)
"""Errors that name a fix the user can make, by module and class. Named rather than imported: an error
of one of these types exists only once its module is, and importing them all would import torch and
pyarrow into every command (tests/test_bad_input.py checks each name is a class)."""


def _known_input_error(exc: BaseException) -> str | None:
    """Errors that name a fix the user can make; anything else is a bug and keeps its traceback."""
    seen: BaseException | None = exc
    while seen is not None:
        if any(f"{kind.__module__}.{kind.__qualname__}" in KNOWN_INPUT_ERRORS for kind in type(seen).__mro__):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
