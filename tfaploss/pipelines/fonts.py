"""Font files read with fontTools for :mod:`tfaploss.pipelines.glyphs`' planning: faces,
their cmaps, and whether a glyph has an outline worth rendering (:meth:`Face.glyph`).
Only the tables needed are read, glyph by glyph (docs/pipelines.md)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import struct
from dataclasses import dataclass, field

from fontTools.ttLib import TTCollection, TTFont

from tfaploss.pipelines import images as I

FONT_EXTENSIONS = (".ttf", ".otf", ".ttc", ".otc")
COLLECTION_EXTENSIONS = (".ttc", ".otc")

# Why a (character, face) pair gives no image: the reasons of the ignored entries.
NOT_IN_CMAP = "not in cmap"
NOTDEF = "mapped to .notdef"
NOTDEF_OUTLINE = "same outline as .notdef"
EMPTY_OUTLINE = "empty outline"

_OUTLINE_TABLES = ("glyf", "CFF ", "CFF2")
# CFF (Type 2) operators that draw, or may draw through a subroutine.
_CFF_DRAWING = frozenset({
    "rlineto", "hlineto", "vlineto", "rrcurveto", "hhcurveto", "vvcurveto", "hvcurveto",
    "vhcurveto", "rcurveline", "rlinecurve", "flex", "hflex", "hflex1", "flex1",
    "callsubr", "callgsubr"})
# A charstring longer than this draws (an empty one is a width and endchar); shorter
# ones are decompiled to make sure, longer ones are left to the FreeType check.
_CFF_SHORT = 16


class FontError(I.ImageError):
    """A font file fontTools cannot read, or one without outlines or a Unicode cmap
    (``code``: ``truncated``, ``undecodable``, ``empty_file``)."""


@dataclass(frozen=True)
class Glyph:
    """What a face maps one character to: ``reason`` (one of the constants above) when
    it gives no image, else the ``fingerprint`` of its outline."""

    reason: str | None = None
    fingerprint: str = ""


class _Table:
    """An outline table, shared by the faces that point at it; read when first needed."""

    def __init__(self, font: TTFont, tag: str):
        self.font, self.tag = font, tag

    @functools.cached_property
    def data(self) -> bytes:
        return self.font.reader[self.tag]

    @functools.cached_property
    def identity(self) -> bytes:
        return hashlib.sha1(self.tag.encode() + self.data).digest()

    @functools.cached_property
    def top(self):
        """The CFF top dict (the table decompiled once, by the first face)."""
        return self.font[self.tag].cff.topDictIndex[0]


@dataclass
class Face:
    """One face of a font file: ``relpath`` of the file, ``index`` in it (0 outside
    collections); :attr:`cmap` maps code points to glyph ids."""

    relpath: str
    index: int
    font: TTFont = field(repr=False)
    table: _Table = field(repr=False)
    _cmap: dict[int, int] | None = field(repr=False, default=None)
    _notdef: str | None = field(repr=False, default=None)

    @property
    def id(self) -> str:
        return f"{self.relpath}#{self.index}"

    @property
    def name(self) -> str:
        try:
            name = self.font["name"].getDebugName(4) or self.font["name"].getDebugName(1)
        except Exception:  # noqa: BLE001 - a broken name table only costs the name
            name = None
        return name or "?"

    @property
    def cmap(self) -> dict[int, int]:
        """Code point -> glyph id, from the face's best Unicode cmap (read once)."""
        if self._cmap is None:
            names = self.font.getBestCmap()
            if names is None:
                raise FontError(I.UNDECODABLE, f"face {self.index} has no Unicode cmap")
            self._cmap = {cp: _gid(name) for cp, name in names.items()}
        return self._cmap

    def glyph(self, cp: int) -> Glyph:
        """Sort character ``cp`` of this face (see the module doc)."""
        gid = self.cmap.get(cp)
        if gid is None:
            return Glyph(NOT_IN_CMAP)
        if gid == 0:
            return Glyph(NOTDEF)
        glyph = self._outline(gid)
        if glyph.reason is None:
            if self._notdef is None:
                self._notdef = self._outline(0).fingerprint
            if glyph.fingerprint == self._notdef:
                return Glyph(NOTDEF_OUTLINE)
        return glyph

    def _outline(self, gid: int) -> Glyph:
        return self._truetype(gid) if self.table.tag == "glyf" else self._cff(gid)

    def _truetype(self, gid: int) -> Glyph:
        loca = self.font["loca"]
        data = self.table.data[loca[gid]:loca[gid + 1]] if gid + 1 < len(loca) else b""
        if len(data) < 10:
            return Glyph(EMPTY_OUTLINE)
        contours, x0, y0, x1, y1 = struct.unpack(">hhhhh", data[:10])
        if contours == 0 or x1 <= x0 or y1 <= y0:
            return Glyph(EMPTY_OUTLINE)
        if contours > 0:
            # Points and flags without the hinting instructions: the same outline in
            # two fonts with their own hinting still matches.
            at = 10 + 2 * contours
            if at + 2 > len(data):
                raise FontError(I.UNDECODABLE, f"glyph {gid} claims {contours} contours "
                                               f"in {len(data)} bytes")
            (n_instructions,) = struct.unpack(">H", data[at:at + 2])
            return Glyph(fingerprint=_digest(b"glyf", data[:at],
                                             data[at + 2 + n_instructions:]))
        # A composite glyph names its components by glyph id: only in the same table.
        return Glyph(fingerprint=_digest(self.table.identity, struct.pack(">I", gid)))

    def _cff(self, gid: int) -> Glyph:
        top = self.table.top
        charstring = top.CharStrings.charStringsIndex[gid]
        if charstring.bytecode is None:  # decompiled before (a short one)
            charstring.compile()
        bytecode = charstring.bytecode
        if len(bytecode) <= _CFF_SHORT:
            charstring.decompile()
            if not any(isinstance(t, str) and t in _CFF_DRAWING for t in charstring.program):
                return Glyph(EMPTY_OUTLINE)
        # Subroutines belong to the table and to the glyph's private dict (CID fonts
        # select one per glyph): only charstrings of the same table and dict match.
        private = top.FDSelect[gid] if hasattr(top, "FDSelect") else -1
        return Glyph(fingerprint=_digest(self.table.identity, struct.pack(">i", private),
                                         bytecode))


def _gid(name: str) -> int:
    # "gid123" as FontFile names them; fontTools' "glyph00123" past the glyph order.
    return int(name[3:]) if name.startswith("gid") else int(name[5:])


def _digest(*parts: bytes) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(struct.pack(">I", len(p)))
        h.update(p)
    return h.hexdigest()[:20]


class FontFile(contextlib.AbstractContextManager):
    """An open font file (a local path) and its :attr:`faces`; a context manager.

    ``cmaps``: the faces' cmaps from an earlier opening (a large one costs 0.1 s to read).
    Raises :class:`FontError` for a file fontTools cannot read, a table beyond its end, a
    face without outlines or Unicode cmap, or a collection without faces.
    """

    def __init__(self, path: str, relpath: str, cmaps: list[dict[int, int]] | None = None):
        self.path, self.relpath = path, relpath
        self._fonts: list[TTFont] = []
        try:
            self.faces = self._read(cmaps)
        except FontError:
            self.close()
            raise
        except Exception as e:
            self.close()
            raise FontError(I.UNDECODABLE, f"fontTools cannot read it: {type(e).__name__}"
                                           + (f": {e}" if str(e) else "")) from e

    def _read(self, cmaps) -> list[Face]:
        size = os.path.getsize(self.path)
        if size == 0:
            raise FontError(I.EMPTY_FILE, "file is empty (0 bytes)")
        with open(self.path, "rb") as f:
            head = f.read(4)
        if self.relpath.lower().endswith(COLLECTION_EXTENSIONS) or head == b"ttcf":
            self._fonts = list(TTCollection(self.path, lazy=True).fonts)
        else:
            self._fonts = [TTFont(self.path, lazy=True)]
        if not self._fonts:
            raise FontError(I.UNDECODABLE, "the collection holds no font")
        tables: dict[tuple[str, int], _Table] = {}
        faces = []
        for index, font in enumerate(self._fonts):
            for tag, entry in font.reader.tables.items():
                if entry.offset + entry.length > size:
                    raise FontError(I.TRUNCATED, f"face {index}: its {tag.strip()} table "
                                                 f"ends at byte {entry.offset + entry.length}"
                                                 f" of a {size}-byte file")
            tag = next((t for t in _OUTLINE_TABLES if t in font.reader), None)
            if tag is None:
                raise FontError(I.UNDECODABLE, f"face {index} has no outlines (glyf, CFF or "
                                               "CFF2 table); bitmap-only fonts are not "
                                               "supported")
            if tag == "glyf" and "loca" not in font.reader:
                raise FontError(I.UNDECODABLE, f"face {index} has a glyf table but no loca")
            key = (tag, font.reader.tables[tag].offset)
            table = tables.get(key)
            if table is None:
                table = tables[key] = _Table(font, tag)
            # Glyphs are found by id, never by name: numbered names spare fontTools
            # reading the post table's names or decompiling the CFF table for them.
            font.setGlyphOrder([f"gid{i}" for i in range(font["maxp"].numGlyphs)])
            face = Face(self.relpath, index, font, table,
                        _cmap=cmaps[index] if cmaps is not None else None)
            face.cmap  # noqa: B018 - read now, so that a face without one fails here
            faces.append(face)
        return faces

    def close(self) -> None:
        for font in self._fonts:
            font.close()
        self._fonts = []

    def __exit__(self, *exc) -> None:
        self.close()
