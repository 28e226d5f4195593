"""tfaploss.run.processes in one process: what a run across processes decides without
launching any (the launches: tests/distribute/test_train_torch.py and
test_train_jax.py).

* one process: rank 0 of 1, nothing to agree on, every collective a no-op;
* a launcher that does not fit the backend is refused, naming both;
* a checkpoint of another world size or global batch is refused, naming both, before
  the run directory changes; a record from before world sizes counts as one process;
* the stop agreement: a signal or a stop on another rank stops this one too;
* ``training.distribute.timeout_s`` is not part of what a resumed run must match.
"""

from __future__ import annotations

import json

import keras
import pytest

from tfaploss.config import ConfigError, config_from_dict
from tfaploss.durable.checkpoints import RunBackup
from tfaploss.durable.preemption import SignalFlag
from tfaploss.run import processes
from tfaploss.run.processes import GroupBackup, ProcessGroup, StopAgreement, check_resume


def test_one_process_is_rank_zero_of_one_and_agrees_with_itself():
    group = processes.current()
    assert (group.rank, group.world_size, group.is_main, group.distributed) == (0, 1, True,
                                                                                False)
    assert group.shard() == {"num_shards": 1, "shard_index": 0}
    assert group.any_rank(3, 0, 15) == (3, 0, 15)
    assert group.main_first(lambda: "done", "testing") == "done"
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert group.local_model(model) is model
    local = SignalFlag()
    assert processes.agreed_stop(local) == (local, [])


@pytest.mark.parametrize("env,flags,named", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, {}, "WORLD_SIZE=2"),
    ({}, {"coordinator": "127.0.0.1:1234", "num_processes": 2, "process_id": 0},
     "--coordinator 127.0.0.1:1234"),
])
def test_several_processes_under_tensorflow_are_refused(env, flags, named, monkeypatch):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="KERAS_BACKEND=tensorflow") as err:
        processes.start(None, **flags)
    assert named in str(err.value) and "library-level" in str(err.value)
    assert not processes.current().distributed


def _backup_with_record(tmp_path, record, name="checkpoint.json"):
    backup = RunBackup(tmp_path / "run" / "backup")
    backup.directory.mkdir(parents=True)
    (backup.directory / name).write_text(json.dumps({"format": 1, "latest": record}))
    return backup


@pytest.mark.parametrize("record,world,batch,refused", [
    ({"epoch": 1, "processes": 2, "global_batch": 8}, 1, 8, ("2 process(es) with a global "
     "batch of 8; this run has 1 process(es) with a global batch of 8")),
    ({"epoch": 1, "processes": 2, "global_batch": 8}, 2, 16, ("2 process(es) with a global "
     "batch of 8; this run has 2 process(es) with a global batch of 16")),
    ({"epoch": 1}, 2, 8, "1 process(es) with its global batch; this run has 2"),
    ({"epoch": 1, "processes": 2, "global_batch": 8}, 2, 8, None),
    ({"epoch": 1}, 1, 8, None),  # written before world sizes were recorded
])
def test_a_checkpoint_of_another_layout_is_refused_naming_both(tmp_path, record, world,
                                                               batch, refused):
    group = ProcessGroup("torch" if world > 1 else "none", 0, world)
    for name in ("checkpoint.json", "step.json"):
        backup = _backup_with_record(tmp_path / name, record, name)
        if refused is None:
            check_resume(backup, group, batch)
            continue
        with pytest.raises(ConfigError) as err:
            check_resume(backup, group, batch)
        assert refused in str(err.value) and f"backup/{name}" in str(err.value)
        assert "--restart" in str(err.value)


def test_train_refuses_another_world_size_before_changing_the_run_directory(tmp_path):
    from tfaploss.run.trainer import train

    cfg = config_from_dict({"run_dir": str(tmp_path / "run"),
                            "data": {"batch_size": 8, "m": 2, "image_size": 16}},
                           warn=False)
    backup = _backup_with_record(tmp_path, {"epoch": 1, "processes": 4,
                                            "global_batch": 8})
    backup.directory.joinpath(".tmp-leftover").write_text("x")  # what rank 0 would clean
    with pytest.raises(ConfigError, match=r"4 process\(es\) with a global batch of 8"):
        train(cfg)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["backup"]
    assert backup.directory.joinpath(".tmp-leftover").exists()


def test_every_checkpoint_records_the_world_size_and_global_batch(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    backup = GroupBackup(tmp_path / "backup", processes.current(), 24)
    backup.save(model, 1, extra={"updates": 5})
    backup.save_step(model, 2, 3)
    for name in ("checkpoint.json", "step.json"):
        latest = json.loads((tmp_path / "backup" / name).read_text())["latest"]
        assert (latest["processes"], latest["global_batch"]) == (1, 24)
    assert json.loads((tmp_path / "backup" / "checkpoint.json").read_text())[
        "latest"]["updates"] == 5
    check_resume(backup, processes.current(), 24)
    with pytest.raises(ConfigError, match="global batch of 24; this run has 1 process"):
        check_resume(backup, processes.current(), 48)


class _Ranks(ProcessGroup):
    """Two ranks whose other rank reports ``other`` (signal, stop, step_us, cost_us) at
    every agreement."""

    def __init__(self, other):
        super().__init__("torch", 0, 2)
        object.__setattr__(self, "other", tuple(other) + (0,) * (4 - len(other)))
        object.__setattr__(self, "calls", [])

    def any_rank(self, *values):
        self.calls.append(values)
        return tuple(max(a, b) for a, b in zip(values, self.other))


def _agreement(other, stop_training=False, signum=None):
    local = SignalFlag()
    local.signum = signum
    agreement = StopAgreement(local, _Ranks(other))
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.stop_training = stop_training
    agreement.set_model(model)
    agreement.on_train_begin()
    return agreement, model


def test_a_signal_or_a_stop_on_another_rank_stops_this_one():
    agreement, model = _agreement((15, 0))
    agreement.on_train_batch_end(0)
    assert agreement.signum == 15 and not model.stop_training
    assert agreement.seconds_since() == 0.0  # this rank received nothing

    agreement, model = _agreement((0, 1))
    agreement.on_epoch_end(0)
    assert agreement.signum is None and model.stop_training

    agreement, model = _agreement((0, 0), stop_training=True, signum=2)
    agreement.on_train_batch_end(0)
    assert agreement.group.calls[0][:2] == (2, 1)  # what this rank tells the others
    assert agreement.signum == 2 and model.stop_training

    agreement, model = _agreement((0, 0))
    agreement.on_train_batch_end(0)
    assert agreement.signum is None and not model.stop_training


def test_agreements_thin_out_when_they_cost_more_than_a_hundredth_of_the_steps():
    # the other rank: 50 ms steps, 4 ms agreements -> every 8th batch (4 / 0.5)
    agreement, model = _agreement((0, 0, 50_000, 4_000))
    agreement.on_train_batch_end(0)
    assert agreement.every == 8 and len(agreement.group.calls) == 1
    model.stop_training = True  # a callback of this rank stops it between agreements
    for batch in range(1, 8):
        agreement.on_train_batch_end(batch)
        # held back: this rank must not leave fit while the others step on
        assert not model.stop_training and len(agreement.group.calls) == 1
    agreement.on_train_batch_end(8)
    assert len(agreement.group.calls) == 2 and agreement.group.calls[1][1] == 1
    assert model.stop_training  # agreed: every rank stops after this batch
    # no more than LATENCY_S between agreements: 1 s steps, 300 ms agreements -> 2
    agreement, _ = _agreement((0, 0, 1_000_000, 300_000))
    agreement.on_train_batch_end(0)
    assert agreement.every == 2
    # cheap beside the steps (0.3 ms, 300 ms): every batch; an epoch's end always
    agreement, _ = _agreement((0, 0, 300_000, 300))
    agreement.on_train_batch_end(0)
    agreement.on_epoch_end(0)
    assert agreement.every == 1 and len(agreement.group.calls) == 2


def test_the_timeout_is_not_part_of_what_a_resumed_run_matches():
    from tfaploss.run.resume import _comparable

    a = config_from_dict({"training": {"distribute": {"timeout_s": 60}}}, warn=False)
    b = config_from_dict({"training": {"distribute": {"timeout_s": 900}}}, warn=False)
    c = config_from_dict({"training": {"distribute": {"devices": 2}}}, warn=False)
    assert a.training.distribute.timeout_s == 60
    assert _comparable(a.to_dict()) == _comparable(b.to_dict())
    assert _comparable(a.to_dict()) != _comparable(c.to_dict())
    with pytest.raises(ConfigError, match="timeout_s"):
        config_from_dict({"training": {"distribute": {"timeout_s": 1}}}, warn=False)
