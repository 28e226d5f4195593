"""What every command's parser shares: the help layout, ``--quiet`` / ``--verbose``, the
run-config flags, and how a command module adds its parser (:func:`add_command`).

Imports nothing heavy, so ``tfaploss --help`` stays instant.
"""

from __future__ import annotations

import argparse

CONFIG_HELP = ("run config: a YAML file, or recipe:NAME for a shipped recipe "
               "(`tfaploss recipes` lists them)")
SET_HELP = (
    "override one config key, YAML-typed; repeatable. Examples: --set training.epochs=3 "
    "--set optimizer.lr=2e-5 --set evaluation.ks=[1,10] --set model.weights=null "
    "--set loss.temperature=0.05"
)


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
             "(and those of tfaploss.models and tfaploss.pipelines)")


def add_config_arguments(p, *, group=None, config_help: str = CONFIG_HELP,
                         set_help: str = SET_HELP) -> None:
    """``--config YAML`` (required, or one choice of the exclusive ``group``) and
    ``--set KEY=VALUE``."""
    (group or p).add_argument("--config", required=group is None, metavar="YAML",
                              help=config_help)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=set_help)


def add_command(sub, name: str, run, add_arguments, **parser_options):
    """The parser of command ``name``: ``add_arguments(parser)``'s flags, then the
    output flags; ``run(args)`` carries it out and returns the exit status."""
    p = sub.add_parser(name, formatter_class=argparse.RawDescriptionHelpFormatter, **parser_options)
    add_arguments(p)
    add_output_flags(p)
    p.set_defaults(func=run)
    return p
