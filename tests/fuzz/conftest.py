"""The fuzz tests' set-up: the hypothesis profiles (:mod:`tests.fuzz.profiles`, registered
on import, ``ci`` loaded unless ``--hypothesis-profile`` names another) and, for ``make
fuzz``, each process's tally of its cases written at the end (:mod:`tests.fuzz.harness`).
"""

from tests.fuzz import harness, profiles  # noqa: F401 - registers the profiles


def pytest_sessionfinish(session, exitstatus):
    harness.write_report()
