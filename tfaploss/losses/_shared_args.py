"""The arguments a ranking loss forwards to its base: spelled out in its signature
(:func:`forwarded_signature`) and documented once (:func:`fill_shared_args`, keras-rs's
docstring template)."""

from __future__ import annotations

import inspect
import re
import textwrap

#: A loss's ``{shared_args}`` becomes the entries whose arguments it takes and does not
#: document itself.
ARGS_DOC = {
    "temperature, rho, delta, start, offset": (
        "the step-rank upper bound, :class:`~tfaploss.ops.smooth_rank.SupAPUpperStep` "
        "(``offset=None``: continuous at ``delta``)."),
    "pairs_per_block": "positive pairs ranked per loop step (``None``: automatic, about "
                       "4M / B); memory is O(pairs_per_block · B).",
    "normalize": "L2-normalise the embeddings first, so scores are cosines in [-1, 1].",
    "include_self": "rank each query against itself too (it counts as its own positive), "
                    "as Smooth-AP's and ROADMAP's code do. Otherwise the query is left out "
                    "of its own ranking, as the histogram-AP paper describes.",
    "drop_lone_queries": "leave out every query whose class has no other item in the "
                         "batch (``docs/losses.md``, \"Lone queries\"); the originals "
                         "mostly keep it. Without ``include_self`` such a query has no "
                         "positive and is always left out.",
    "reduction": "how the per-query terms are reduced (``docs/losses.md``).",
    "name, dtype": "as for ``keras.losses.Loss``; ``float16``/``bfloat16`` are refused "
                   "(they cannot hold label ids exactly).",
}


def forwarded_signature(cls):
    """The signature of ``cls.__init__`` with the parent's arguments (less
    ``cls.unused_args``) in place of ``*args`` and, keyword-only, ``**kwargs``."""
    own = inspect.signature(cls.__dict__["__init__"]).parameters
    parent = [p for p in inspect.signature(super(cls, cls).__init__).parameters.values()
              if p.name not in own and p.name not in cls.unused_args]
    params = []
    for p in own.values():
        if p.kind == p.VAR_POSITIONAL:
            params += [q for q in parent if q.kind == q.POSITIONAL_OR_KEYWORD]
        elif p.kind == p.VAR_KEYWORD:
            params += [q.replace(kind=q.KEYWORD_ONLY) for q in parent if q not in params]
        else:
            params.append(p)
    return inspect.Signature(params)


def fill_shared_args(cls):
    """``{shared_args}`` in the docstring of ``cls`` replaced by the entries of
    :data:`ARGS_DOC` that it takes and does not document itself, with its defaults."""
    if not cls.__doc__ or "{shared_args}" not in cls.__doc__:
        return
    params = inspect.signature(cls).parameters
    lines = []
    for args, text in ARGS_DOC.items():
        names = args.split(", ")
        documented = rf"^ +(\w+, )*{names[0]}(, \w+)*:"
        if not all(n in params for n in names) or re.search(documented, cls.__doc__,
                                                            re.MULTILINE):
            continue
        if isinstance(params[names[0]].default, bool):
            text += f" Default: {params[names[0]].default}."
        lines.append(textwrap.fill(f"{args}: {text}", 88, initial_indent=" " * 8,
                                   subsequent_indent=" " * 12))
    cls.__doc__ = cls.__doc__.replace("{shared_args}", "\n".join(lines))
