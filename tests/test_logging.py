"""Output goes through logging (tfaploss.log): no print in library code, the CLI's
--quiet / --verbose, the plain handler, nothing configured on import, and the in-graph
warning of the losses routed back to Python."""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The command line (tfaploss/cli/) talks to a person directly; everything else logs.
MAY_PRINT = "tfaploss/cli/"
ESCAPES = ("\x1b", "\r", "\x08")


def _library_modules():
    for package in ("tfaploss",):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if not rel.startswith(MAY_PRINT):
                yield rel, path


def _prints(tree: ast.AST) -> list[int]:
    """Lines that use the builtin ``print`` (called, or passed on as ``log=print``) or
    ``tf.print``."""
    lines = []
    for node in ast.walk(tree):
        builtin = (isinstance(node, ast.Name) and node.id == "print"
                   and isinstance(node.ctx, ast.Load))
        tf_print = (isinstance(node, ast.Attribute) and node.attr == "print"
                    and isinstance(node.value, ast.Name) and node.value.id in ("tf", "tensorflow"))
        if builtin or tf_print:
            lines.append(node.lineno)
    return lines


def test_library_code_never_prints():
    offenders = {}
    for rel, path in _library_modules():
        found = _prints(ast.parse(path.read_text(encoding="utf-8"), filename=rel))
        if found:
            offenders[rel] = found
    assert offenders == {}, (
        "log through logging.getLogger(__name__) instead of print (see tfaploss/log.py): "
        f"{offenders}")


def test_the_scan_finds_a_print():
    tree = ast.parse("def f(log=print):\n    print('x')\n    tf.print('y')\n")
    assert sorted(_prints(tree)) == [1, 2, 3]


@pytest.mark.slow
def test_importing_configures_no_logging():
    """Importing the library (and the jobs' shared modules) installs no root handler and
    sets no level; the tfaploss logger only has its NullHandler."""
    code = (
        "import logging\n"
        "import tfaploss, tfaploss.durable.faults, tfaploss.log, tfaploss.cli\n"
        "import tfaploss.durable.checkpoints, tfaploss.run.trainer\n"
        "import tfaploss.evaluation.evaluator\n"
        "import tfaploss.pipelines.runner, tfaploss.pipelines.embed\n"
        "root = logging.getLogger()\n"
        "t = logging.getLogger('tfaploss')\n"
        "print(len(root.handlers), root.level, t.level,\n"
        "      [type(h).__name__ for h in t.handlers],\n"
        "      logging.getLogger('tfaploss.pipelines').level)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=240, check=False,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
                               "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-2] == "0 30 0 ['NullHandler'] 0", done.stdout


@pytest.mark.parametrize("command", [
    ["train", "--config", "c.yaml"],
    ["evaluate", "--model", "m.keras", "--data", "d"],
    ["export", "--model", "m.keras", "--out", "o"],
    ["demo", "--quick"],
    ["config", "--config", "c.yaml"],
])
def test_quiet_and_verbose_are_accepted_before_and_after_every_command(command):
    from tfaploss.cli import build_parser

    parser = build_parser()
    plain = parser.parse_args(command)
    assert not getattr(plain, "quiet", False) and not getattr(plain, "verbose", False)
    for flag, name in (("--quiet", "quiet"), ("-q", "quiet"), ("--verbose", "verbose"),
                       ("-v", "verbose")):
        for argv in ([flag, *command], [*command, flag]):
            args = parser.parse_args(argv)
            assert getattr(args, name) is True, argv
            other = "verbose" if name == "quiet" else "quiet"
            assert not getattr(args, other, False), argv


def test_the_command_handler_writes_plain_lines_to_the_right_stream():
    from tfaploss import log

    logger = logging.getLogger("tfaploss.test_logging")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with log.command_output(logging.INFO):
            logger.debug("hidden")
            logger.info("progress %d", 1)
            logger.warning("warning: careful")
            logging.getLogger("tfaploss.pipelines.x").info("hidden too")  # WARNING by default
            logging.getLogger("tfaploss.pipelines.x").warning("shown")
        with log.command_output(logging.WARNING):
            logger.info("quiet")
            logger.error("error: bad")
        with log.command_output(logging.DEBUG, detailed=True, others_level=logging.DEBUG):
            logger.debug("detail")
            logging.getLogger("tfaploss.pipelines.x").debug("job detail")
    assert out.getvalue().splitlines()[:1] == ["progress 1"]
    assert err.getvalue().splitlines() == ["warning: careful", "shown", "error: bad"]
    detailed = out.getvalue().splitlines()[1:]
    assert [line.split(" ", 2)[2] for line in detailed] == [
        "tfaploss.test_logging DEBUG: detail", "tfaploss.pipelines.x DEBUG: job detail"]
    for code in ESCAPES:
        assert code not in out.getvalue() + err.getvalue()
    # Everything as it was.
    assert logging.getLogger("tfaploss").level == logging.NOTSET
    assert logging.getLogger("tfaploss.pipelines").level == logging.NOTSET


def test_reporting_shows_info_only_where_logging_is_not_configured(capsys):
    from tfaploss import log

    logger = logging.getLogger("tfaploss.test_logging")
    with log.reporting():
        logger.info("shown")
        logger.warning("warning: also shown")
    logger.info("not outside the block")
    captured = capsys.readouterr()
    assert captured.out == "shown\n" and captured.err == "warning: also shown\n"
    # An application that configured the tfaploss logger gets the lines its way only.
    mine = logging.Handler()
    records = []
    mine.emit = records.append
    tfaploss_logger = logging.getLogger("tfaploss")
    tfaploss_logger.addHandler(mine)
    tfaploss_logger.setLevel(logging.INFO)
    try:
        with log.reporting():
            logger.info("to the application")
    finally:
        tfaploss_logger.removeHandler(mine)
        tfaploss_logger.setLevel(logging.NOTSET)
    assert [r.getMessage() for r in records] == ["to the application"]
    assert capsys.readouterr().out == ""


def test_graph_mode_warning_goes_through_python_warnings():
    """The losses' "no positive pair" check inside a tf.function: a Python warning (once
    per process), not a tf.print to the process's stderr."""
    import numpy as np
    import tensorflow as tf

    from tfaploss.losses import SmoothAPLoss
    from tfaploss.ops import tensorflow_kernels as K

    K._WARNED.clear()
    loss = SmoothAPLoss()
    step = tf.function(lambda y, x: loss(y, x))
    x = tf.math.l2_normalize(tf.constant(np.random.default_rng(0).normal(size=(6, 4)),
                                         tf.float32), -1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(tf.constant([0, 0, 1, 1, 2, 2]), x)  # positives: nothing to say
        assert caught == []
        step(tf.range(6), x)
        step(tf.range(6), x)
    assert len(caught) == 1 and caught[0].category is RuntimeWarning
    assert str(caught[0].message).startswith("tfaploss: a batch had no pair of items")


def test_command_lines_are_not_shown_again_by_a_root_handler():
    """Importing Beam logs a warning on the root logger, which installs a root
    handler; the command's lines must still be shown once, by the command's handler."""
    from tfaploss import log

    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    try:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            with log.command_output(logging.INFO):
                logging.getLogger("tfaploss.test_logging").info("once")
                logging.getLogger("tfaploss.pipelines.x").warning("job warning")
        assert out.getvalue() == "once\n" and err.getvalue() == "job warning\n"
        assert root_stream.getvalue() == ""
        assert logging.getLogger("tfaploss").propagate  # as it was
    finally:
        logging.getLogger().removeHandler(root_handler)
