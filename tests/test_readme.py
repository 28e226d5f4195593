"""Every command in the README's code blocks is checked: the Python blocks run as written,
``tfaploss`` commands parse with the real parser, ``python -m pipelines.<job>`` flags are
in the job's ``--help``, ``make`` targets and ``pip install`` extras exist, and every
repository path a command names is there. What needs a network or a server (docker, curl)
is only named, in ``NOT_RUN``."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```(\w*)\n(.*?)```", README, flags=re.S)
# Commands the suite cannot run offline; their flags belong to other programs.
NOT_RUN = ("docker", "curl", "tensorboard")


def _commands():
    for lang, body in BLOCKS:
        if lang != "bash":
            continue
        for command in body.replace("\\\n", " ").splitlines():
            command = command.split(" #")[0].strip()
            if command and not command.startswith("#"):
                yield shlex.split(command)


COMMANDS = list(_commands())


def _by(program):
    return [c for c in COMMANDS if c[0] == program]


def test_every_command_is_checked_or_named():
    checked = {"pip", "make", "tfaploss", "python"}
    assert {c[0] for c in COMMANDS} <= checked | set(NOT_RUN)
    assert _by("tfaploss") and _by("python") and _by("make") and _by("pip")


def test_pip_extras_exist():
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    extras = set(re.findall(r'^\s+"([a-z]+)": ', setup, flags=re.M))
    for command in _by("pip"):
        for spec in command[2:]:
            for extra in re.findall(r"\[([a-z,]+)\]", spec):
                assert set(extra.split(",")) <= extras, command


def test_make_targets_exist():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.M))
    for command in _by("make"):
        assert command[1] in targets, command


@pytest.mark.parametrize("command", _by("tfaploss"), ids=" ".join)
def test_tfaploss_commands_parse(command):
    from tfaploss.cli import build_parser

    build_parser().parse_args(command[1:])  # exits (SystemExit) on an unknown flag
    for word in command:
        if word.startswith("configs/"):
            assert (REPO / word).is_file(), word


@pytest.mark.parametrize("command", _by("python"), ids=" ".join)
@pytest.mark.slow
def test_pipeline_job_flags_are_in_its_help(command):
    assert command[1] == "-m" and command[2].startswith("tfaploss.pipelines."), command
    result = subprocess.run([sys.executable, "-m", command[2], "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    for flag in (w for w in command[3:] if w.startswith("--")):
        assert flag.split("=")[0] in result.stdout, (flag, command[2])


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i, (lang, _) in enumerate(BLOCKS) if lang == "python"])
def test_python_blocks_run(index, tmp_path):
    result = subprocess.run([sys.executable, "-c", BLOCKS[index][1]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600, check=False,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO),
                                 "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode == 0, result.stderr[-3000:]
