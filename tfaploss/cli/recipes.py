"""``tfaploss recipes``: the run configs shipped with tfaploss, listed; ``recipes show
NAME`` prints one as shipped."""

from __future__ import annotations

import os
import sys
import textwrap

from tfaploss.cli.arguments import add_command
from tfaploss.log import is_terminal


def register(sub) -> None:
    add_command(
        sub, "recipes", cmd_recipes, _arguments,
        help="list the recipes shipped with tfaploss; `recipes show NAME` prints one",
        description=textwrap.dedent("""\
            The run configs shipped with tfaploss: the papers' recipes (their and the
            authors' values) and the demo's. Listed with their descriptions; `show NAME`
            prints one as shipped, comments included, to start your own config from.
            Any --config takes recipe:NAME to run one as it is (with --set overrides)."""),
        epilog=textwrap.dedent("""\
            examples:
              tfaploss recipes
              tfaploss recipes show smoothap_sop_resnet50 > my_run.yaml
              tfaploss train --config recipe:smoothap_sop_resnet50 \\
                  --set data.train=data/sop/train --set data.test=data/sop/test"""))


def _arguments(p) -> None:
    actions = p.add_subparsers(dest="recipes_action", metavar="ACTION")
    add_command(actions, "show", cmd_recipes,
                lambda show: show.add_argument("name", metavar="NAME",
                                               help="a recipe's name (see `tfaploss recipes`)"),
                help="print one recipe's YAML as shipped",
                description="Print recipe NAME's YAML as shipped.")


def cmd_recipes(args) -> int:
    from tfaploss.config.recipes import list_recipes, recipe_text, recipes_dir

    try:
        if args.recipes_action == "show":
            sys.stdout.write(recipe_text(args.name))  # verbatim: `> my.yaml` starts a config
            sys.stdout.flush()
            return 0
        recipes = list_recipes()
        width = max((len(r.name) for r in recipes), default=0)
        for recipe in recipes:
            print(f"{recipe.name:<{width}}  {recipe.description}")
        if is_terminal():  # the hint for a person; a pipe gets the table alone
            print(f"\n{len(recipes)} recipes in {recipes_dir()}. Start a config from one: "
                  "tfaploss recipes show NAME > my.yaml; run one as it is: tfaploss train "
                  "--config recipe:NAME")
        sys.stdout.flush()
    except BrokenPipeError:
        # `tfaploss recipes | head`: the reader stopped early; what is left unwritten goes
        # to /dev/null, so that the interpreter's last flush raises no second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
