"""What every command's parser shares: the help layout, ``--quiet`` / ``--verbose``, and
how a command module adds its parser (:func:`add_command`).

Imports nothing heavy, so ``tfaploss --help`` stays instant.
"""

from __future__ import annotations

import argparse


class Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def add_output_flags(p, *, top: bool = False) -> None:
    """``--quiet`` / ``--verbose``, on the main parser and on every command (there
    with defaults suppressed, so ``tfaploss --quiet train`` keeps the main one)."""
    default = False if top else argparse.SUPPRESS
    group = p.add_argument_group("output")
    group.add_argument(
        "-q", "--quiet", action="store_true", default=default,
        help="show only warnings, errors and the results (evaluate's table, the paths "
             "written): no progress bars (train: one line per epoch)")
    group.add_argument(
        "-v", "--verbose", action="store_true", default=default,
        help="also show debug messages, each line with its time, logger and level "
             "(and those of the models and pipelines packages)")


def add_command(sub, name: str, run, add_arguments, **parser_options):
    """The parser of command ``name``: ``add_arguments(parser)``'s flags, then the
    output flags; ``run(args)`` carries it out and returns the exit status."""
    p = sub.add_parser(name, formatter_class=Formatter, **parser_options)
    add_arguments(p)
    add_output_flags(p)
    p.set_defaults(func=run)
    return p
