"""The ``rlrounds`` command line. Heavy imports (torch, prefect, mlflow) happen inside commands, so
``rlrounds --help`` answers at once.

Errors the user can fix end in one line naming the problem and the fix (exit 2); ``--debug`` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid

EXIT_USAGE = 2


class UserError(Exception):
    """A problem with the user's input; printed as one line."""


def _quiet_libraries(debug: bool) -> None:
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "DEBUG" if debug else "WARNING")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    logging.getLogger("mlflow").setLevel(logging.DEBUG if debug else logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.DEBUG if debug else logging.WARNING)
    import warnings

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
    from storage.paths import StorageRoot

    root = StorageRoot.of(uri)
    probe = root.join(f".write-probe-{uuid.uuid4().hex}")
    try:
        root.fs.makedirs(root.uri, exist_ok=True)
        with root.fs.open(probe, "wb") as f:
            f.write(b"ok")
        root.fs.rm(probe)
    except Exception as exc:  # noqa: BLE001 -- any failure means the root is unusable
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise UserError(f"storage root {uri} is not writable ({reason}); pass --storage with a writable directory or s3:// URI") from None


def cmd_run(args: argparse.Namespace) -> int:
    from flows.config import ConfigError, load_campaign_config

    try:
        config = load_campaign_config(args.config, rounds=args.rounds, run_id=args.run_id)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    storage = args.storage or _settings_storage()
    check_storage_writable(storage)
    os.environ["RLROUNDS_STORAGE"] = storage
    from flows.campaign import rl_campaign

    print(f"rlrounds: campaign of {config.round and config.rounds} rounds, storage {storage}", flush=True)
    start = time.perf_counter()
    result = rl_campaign(config, storage=storage)
    rounds = result["rounds"]
    minutes = (time.perf_counter() - start) / 60
    print(
        f"campaign {result['run_id']}: held-out accuracy {rounds[0]['accuracy']:.1%} -> {rounds[-1]['accuracy']:.1%} "
        f"in {len(rounds) - 1} rounds, {minutes:.1f} min; final model {result['final_model_version']}",
        flush=True,
    )
    return 0


def _settings_storage() -> str:
    from storage.settings import settings

    return settings().storage


def cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from flows.config import CampaignConfig

    print(yaml.safe_dump(CampaignConfig().model_dump(mode="json"), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlrounds", description="RL post-training of language models as auditable rounds.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a campaign of RL rounds")
    run.add_argument("--rounds", type=int, help="number of rounds (default: the config's, 16)")
    run.add_argument("--config", help="YAML or JSON campaign config (see `rlrounds config`)")
    run.add_argument("--storage", help="storage root: a directory or s3://bucket/prefix (default $RLROUNDS_STORAGE or ./rlrounds-data)")
    run.add_argument("--run-id", help="campaign id (default: a fresh one)")
    run.set_defaults(func=cmd_run)

    config = sub.add_parser("config", help="print the default campaign config as YAML")
    config.set_defaults(func=cmd_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _quiet_libraries(args.debug)
    _setup_logging()
    if args.debug:
        return args.func(args)
    try:
        return args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- one line for known input problems, traceback on --debug
        message = _known_input_error(exc)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _known_input_error(exc: BaseException) -> str | None:
    """Errors that name a fix the user can make; anything else is a bug and keeps its traceback."""
    from models.policy import PolicyLoadError
    from tasks.prompts import PromptError

    known: tuple[type[BaseException], ...] = (PolicyLoadError, PromptError)
    try:
        from storage.lineage import LineageError
        from storage.trajectories import TrajectoryStoreError

        known += (LineageError, TrajectoryStoreError)
    except ImportError:
        pass
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, known):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return None


if __name__ == "__main__":
    sys.exit(main())
