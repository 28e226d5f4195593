"""Where an export's versions live: TF Serving's integer-named version folders under a
model base folder, and the metadata each version carries."""

from __future__ import annotations

import json
import os

METADATA_FILE = os.path.join("assets.extra", "tfaploss_export.json")


def versions(path) -> list[int]:
    """The integer-named sub-directories of ``path`` (TF Serving's version folders)."""
    return [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(path) else []


def next_version(path) -> int:
    """1 + the largest integer-named sub-directory of ``path`` (1 when none)."""
    return max(versions(path), default=0) + 1


def find_saved_model(path) -> str:
    """The SavedModel folder ``path`` names: ``path`` itself when it holds
    ``saved_model.pb``, else its newest version folder (as TF Serving serves it); a
    FileNotFoundError when it holds neither."""
    path = os.fspath(path)
    if os.path.exists(os.path.join(path, "saved_model.pb")):
        return path
    found = versions(path)
    if not found:
        raise FileNotFoundError(f"{path!r} is not a SavedModel folder (no saved_model.pb, "
                                "no version folders)")
    return os.path.join(path, str(max(found)))


def read_export_metadata(path) -> dict:
    """The export metadata (``assets.extra/tfaploss_export.json``) of the SavedModel
    ``path`` names; a FileNotFoundError when there is none, or no metadata (not written
    by :func:`tfaploss.export.export_saved_model`)."""
    folder = find_saved_model(path)
    try:
        with open(os.path.join(folder, METADATA_FILE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder!r} holds no {METADATA_FILE} (not written by "
                                "tfaploss export)") from None
