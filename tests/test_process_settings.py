"""tfaploss.process_settings: the cores a process may use; a process-wide setting held by
holders that overlap."""

import os
import threading

import pytest

from tfaploss.process_settings import HeldSetting, available_cores


class _Setting:
    def __init__(self, value):
        self.value, self.writes = value, []

    def read(self):
        return self.value

    def write(self, value):
        self.value = value
        self.writes.append(value)


def test_overlapping_holders_restore_once_what_the_first_found():
    """A enters, B enters, A leaves (still held for B), B leaves (restored): a
    save-and-restore per holder would give back 1 here, the value A set."""
    setting = _Setting(8)
    held = HeldSetting(setting.read, setting.write, 1)
    a, b = held.held(), held.held()
    a.__enter__()
    b.__enter__()
    assert setting.value == 1
    a.__exit__(None, None, None)
    assert setting.value == 1
    b.__exit__(None, None, None)
    assert setting.value == 8
    assert setting.writes == [1, 8]  # written at the first entry and the last exit only


def test_an_exception_inside_still_restores_and_propagates():
    setting = _Setting("on")
    held = HeldSetting(setting.read, setting.write, "off")
    with pytest.raises(KeyError), held.held():
        assert setting.value == "off"
        raise KeyError("x")
    assert setting.value == "on"
    setting.value = "changed meanwhile"  # the next hold saves what it finds then
    with held.held():
        pass
    assert setting.value == "changed meanwhile"


def test_many_threads_leave_it_as_found():
    setting = _Setting(3)
    held = HeldSetting(setting.read, setting.write, 0)
    inside = threading.Barrier(6)
    seen = []

    def hold():
        with held.held():
            inside.wait(timeout=30)  # all six inside at once
            seen.append(setting.value)

    threads = [threading.Thread(target=hold) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == [0] * 6 and setting.value == 3 and setting.writes == [0, 3]


def test_available_cores_is_the_affinity_and_the_cpu_count_without_one(monkeypatch):
    """Where the OS has an affinity, a process pinned to fewer cores than the machine has
    gets those cores; elsewhere the machine's count, and never 0 (an unknown count)."""
    if hasattr(os, "sched_getaffinity"):
        assert available_cores() == len(os.sched_getaffinity(0))
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
        assert available_cores() == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert available_cores() == 6
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert available_cores() == 1
