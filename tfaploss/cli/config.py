"""``tfaploss config``: a run config validated and printed whole; how every command
loads a run config (:func:`load_run_config`) and shows its notes."""

from __future__ import annotations

import sys

from tfaploss.cli.arguments import add_command, add_config_arguments


def register(sub) -> None:
    add_command(sub, "config", cmd_config, add_config_arguments,
                help="validate a run config and print it with every default filled in",
                description="Load a run config, apply --set overrides, validate it, and "
                            "print the result as YAML. Exits 2 with the offending key named "
                            "when the config is invalid.")


def cmd_config(args) -> int:
    import yaml

    print(yaml.safe_dump(load_run_config(args).to_dict(), sort_keys=False), end="")
    return 0


def load_run_config(args):
    """The config ``args.config`` names, with ``args.set``'s overrides, its notes shown
    as :func:`show_config_notes` shows them."""
    from tfaploss.config import load_config

    show_config_notes()
    return load_config(args.config, args.set)


def show_config_notes() -> None:
    """How every command presents a config's notes: each
    :class:`~tfaploss.config.ConfigWarning` as a ``note: ...`` line on stderr, other
    warnings as Python formats them."""
    import warnings

    from tfaploss.config import ConfigWarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            print(f"note: {message}", file=sys.stderr)
        else:
            print(warnings.formatwarning(message, category, filename, lineno, line),
                  file=sys.stderr, end="")

    warnings.showwarning = show
