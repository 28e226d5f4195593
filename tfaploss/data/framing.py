"""TFRecord framing and its CRC-32C: one home for the writers and the checks.

A TFRecord is ``uint64 length``, the masked CRC-32C of those 8 bytes, the data, and the
masked CRC-32C of the data. The pipelines' workers frame records with
:func:`frame_record` (without TensorFlow); :mod:`tfaploss.data.record_checks` reads the
framing back, and the manifest records each shard's :func:`file_checksum` (why CRC-32C:
docs/reliability.md, "Checksums").
"""

from __future__ import annotations

import mmap
import os
import struct

ALGORITHM = "crc32c"
HEADER = 12  # uint64 length + masked CRC-32C of the length
FOOTER = 4   # masked CRC-32C of the data
_CHUNK = 8 << 20  # bytes per read when checksumming a whole file


def _crc32c_functions():
    """``(value(data) -> int, extend(crc, data) -> int)`` of the fastest CRC-32C at hand:
    google-crc32c (the pipelines extra), crc32c, crcmod (a Beam dependency), else a
    table in Python (correct, about 10 MB/s)."""
    try:
        import google_crc32c

        return (lambda d: google_crc32c.value(bytes(d)),
                lambda c, d: google_crc32c.extend(c, bytes(d)))
    except ImportError:
        pass
    try:
        import crc32c as _crc32c

        return _crc32c.crc32c, lambda c, d: _crc32c.crc32c(d, c)
    except ImportError:
        pass
    try:
        import crcmod.predefined

        fn = crcmod.predefined.mkPredefinedCrcFun("crc-32c")
        return fn, lambda c, d: fn(d, c)
    except ImportError:
        pass
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)

    def extend(crc, data):
        crc ^= 0xFFFFFFFF
        for b in bytes(data):
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc ^ 0xFFFFFFFF

    return (lambda d: extend(0, d)), extend


crc32c, crc32c_extend = _crc32c_functions()


def masked_crc(data: bytes) -> int:
    """The masked CRC-32C a TFRecord frame stores for ``data``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the bytes, their masked CRC-32C."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc(length)) + data
            + struct.pack("<I", masked_crc(data)))


def file_checksum(path: str) -> dict:
    """``{"bytes": size, "crc32c": 8 hex digits, "records": n}`` of a TFRecord file (one
    read; ``records`` counts the framing's records, without checking their CRCs)."""
    size = os.path.getsize(path)
    crc, records, offset = 0, 0, 0
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            for start in range(0, size, _CHUNK):
                crc = crc32c_extend(crc, mm[start:start + _CHUNK])
            while offset + HEADER <= size:
                (length,) = struct.unpack_from("<Q", mm, offset)
                offset += HEADER + length + FOOTER
                records += 1
    return {"bytes": size, ALGORITHM: f"{crc:08x}", "records": records}


def manifest_checksums(split_dir: str, files: list[str]) -> dict:
    """The manifest's ``checksums`` entry for ``files`` (paths relative to
    ``split_dir``): ``{"algorithm": "crc32c", "files": {name: file_checksum}}``."""
    return {"algorithm": ALGORITHM,
            "files": {name: file_checksum(os.path.join(split_dir, name))
                      for name in sorted(files)}}
