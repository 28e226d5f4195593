"""The demo `make demo` runs, in its reduced mode: digits -> Beam -> train -> ScaNN -> serve."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_quick_demo_improves_recall_on_unseen_digits(tmp_path, capsys):
    from tfaploss.cli.demo import run_demo
    from tfaploss.demo import QUICK_STEPS

    out = tmp_path / "demo"
    assert run_demo(out=str(out), quick=True) == 0
    printed = capsys.readouterr().out
    assert f"Everything is in {out.resolve()}" in printed
    assert "recall@1" in printed and "[7/7]" in printed

    report = json.loads((out / "demo_summary.json").read_text())
    before, after = report["before"], report["after"]
    # Retrieval on digits 6-9, never seen in training, got better.
    assert after["recall@1"] > before["recall@1"]
    assert after["map@r"] > before["map@r"]
    assert report["loss_last_epoch"] < report["loss_first_epoch"]
    assert report["updates"] == QUICK_STEPS
    assert report["batch_size"] > report["chunk_size"]  # the multi-stage path ran
    assert report["served_cosine_vs_keras"] > 0.999
    # The export's retrieve signature searched the test split: the query digit's nearest
    # neighbour is its own record (its key as the Beam job recorded it), best first.
    retrieved = report["retrieved"]
    assert len(retrieved) == 5 and retrieved[0]["key"] == report["retrieve_query"]
    assert retrieved[0]["digit"] == "6" and retrieved[0]["label"] == 0
    scores = [hit["score"] for hit in retrieved]
    assert scores == sorted(scores, reverse=True)
    assert "saved_model_cli run --dir" in printed and (out / "query.npy").is_file()

    # Every promised output is in the one folder.
    assert (out / "tfrecords" / "train" / "manifest.json").is_file()
    manifest = json.loads((out / "tfrecords" / "test" / "manifest.json").read_text())
    assert manifest["num_classes"] == 4 and manifest["num_failures"] == 0
    assert (out / "run" / "model.keras").is_file()
    assert (out / "evaluation" / "metrics.json").is_file()
    assert list((out / "evaluation").glob("*.png"))
    assert list((out / "saved_model").glob("*/saved_model.pb"))


def test_demo_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    from tfaploss.cli.demo import run_demo

    precious = tmp_path / "my_photos"
    precious.mkdir()
    (precious / "holiday.jpg").write_bytes(b"not the demo's")
    with pytest.raises(SystemExit, match="not written by the demo"):
        run_demo(out=str(precious), quick=True)
    assert (precious / "holiday.jpg").read_bytes() == b"not the demo's"
