"""The ``tfaploss`` command. Each command is a module of this package holding its flags,
its run and all it prints for a person (the library below only logs); this one registers
them and turns errors into exit statuses. Heavy imports happen inside the commands, so
``--help`` is instant. What the commands report goes through the ``tfaploss`` loggers
(:mod:`tfaploss.log`), shown as plain lines: INFO by default, warnings and errors with
``--quiet``, everything with ``--verbose`` (before or after the command name).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import textwrap

from tfaploss.cli import compare, config, demo, evaluate, export, recipes, train, verify
from tfaploss.cli.arguments import add_output_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfaploss", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            tfaploss: train image-retrieval embeddings by directly optimising Average
            Precision (histogram AP, FastAP, Smooth-AP, ROADMAP, PNP) in Keras 3.

            New here? Run `tfaploss demo`, then read README.md; `tfaploss recipes`
            lists the papers' recipes. Data preparation is done by the Beam jobs:
            python -m tfaploss.pipelines.<sop|inaturalist|gldv2|revisited|folder|
            tfds_source|glyphs> --help"""))
    from tfaploss import __version__

    parser.add_argument("--version", action="version", version=f"tfaploss {__version__}")
    add_output_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (demo, train, evaluate, export, config, recipes, compare, verify):
        command.register(sub)
    return parser


def _quiet_tensorflow(argv: list[str]) -> None:
    """Keep TensorFlow's C++ start-up lines (a ``cuInit`` error without a GPU, oneDNN
    notices) off the terminal unless ``--verbose``: run before TensorFlow loads, since it
    reads ``TF_CPP_MIN_LOG_LEVEL`` once (3: 2 still shows the ``cuInit`` error). A value
    the user set is kept."""
    if not any(a in ("-v", "--verbose") for a in argv):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")


# Errors shown as one line on stderr, no traceback, with their exit status; looked up
# only when their module is loaded (by the command that can raise them).
_ONE_LINE_ERRORS = (
    ("tfaploss.config", "ConfigError", 2),
    ("tfaploss.extras", "MissingExtraError", 2),
    ("builtins", "FileNotFoundError", 1),
    ("tfaploss.training.guards", "NonFiniteTrainingError", 3),
    ("tfaploss.run.processes", "RankStoppedError", 1),  # rank 0 stopped
    ("tfaploss.data.integrity", "DamagedDataError", 2),  # a damaged record file
    ("tfaploss.compare.protocol", "DamagedLedgerError", 2),  # a damaged compare ledger
    # A damaged run directory, or one another run holds: like a config error.
    ("tfaploss.durable.checkpoints", "DamagedRunError", 2),
    ("tfaploss.durable.locks", "LockError", 2),
)


def _one_line_status(err: Exception) -> int | None:
    """The exit status of an error shown as one line, else None."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return 2  # a full disk
    for module, name, status in _ONE_LINE_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(err, getattr(loaded, name)):
            return status
    return None


def main(argv: list[str] | None = None) -> int:
    _quiet_tensorflow(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.quiet = bool(getattr(args, "quiet", False))
    args.verbose = bool(getattr(args, "verbose", False))
    if args.quiet and args.verbose:
        parser.error("--quiet and --verbose exclude each other")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from tfaploss.cli.output import finish, guarded_stdout
    from tfaploss.log import command_output

    level = logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO
    output = command_output(level, detailed=args.verbose,  # tfaploss.log: who sees what
                            others_level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        with output as shown, guarded_stdout():
            status = int(args.func(args) or 0)
            finish(shown)  # output on a full disk: an error while it can still be told
            return status
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        # SIGTERM / Ctrl-C during training: checkpointed; the shell's status of the signal.
        preemption = sys.modules.get("tfaploss.durable.preemption")
        if preemption is not None and isinstance(err, preemption.Preempted):
            print(f"tfaploss: {err}", file=sys.stderr)
            return err.status
        status = _one_line_status(err)
        if status is None:
            raise
        print(f"error: {err}", file=sys.stderr)
        return status
