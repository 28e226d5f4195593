#!/bin/sh
# Fetch Debian's CJK font packages WITHOUT installing them, for `make data-glyphs`:
# `apt-get download` puts each .deb in DEST/debs/, `dpkg-deb -x` unpacks it into
# DEST/extracted/ (the fonts land under DEST/extracted/usr/share/fonts/). Nothing is
# installed on the system and no root is needed, except for the one `apt-get update`
# run when apt knows no package lists yet.
#
# A package already fetched (its .deb and an extraction stamp in DEST/debs/) is
# skipped; a package apt cannot download is reported and left out.
#
#     sh tfaploss/pipelines/fetch_fonts.sh [DEST [PACKAGE...]]      (DEST: data/fonts)
set -eu

DEST=${1:-data/fonts}
[ "$#" -gt 0 ] && shift
PACKAGES=${*:-"fonts-noto-cjk fonts-wqy-microhei fonts-wqy-zenhei fonts-arphic-ukai
fonts-arphic-uming fonts-ipafont-gothic fonts-ipafont-mincho fonts-ipaexfont-gothic
fonts-ipaexfont-mincho fonts-nanum fonts-unfonts-core fonts-hanazono fonts-vlgothic
fonts-takao-gothic fonts-umeplus fonts-cwtex-kai fonts-baekmuk
fonts-morisawa-bizud-gothic fonts-morisawa-bizud-mincho"}

say() { echo "fetch_fonts: $*" >&2; }

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    say "no apt-get: put font files in data/fonts/ yourself and run" \
        "\`make data-glyphs FONTS=data/fonts\`"
    exit 1
fi

DEBS=$DEST/debs
EXTRACTED=$DEST/extracted
mkdir -p "$DEBS" "$EXTRACTED"

# `apt-get download` needs the package lists, which a fresh machine may not have yet.
if ! apt-cache policy fonts-noto-cjk 2>/dev/null | grep -q 'Candidate: [^(]'; then
    say "apt knows no fonts-noto-cjk candidate; running apt-get update once"
    apt-get update -qq || say "apt-get update failed; trying the downloads anyway"
fi

# apt drops to its `_apt` user to download; a folder that user can write avoids the
# "download is performed unsandboxed as root" warning.
TMP=$(mktemp -d "$DEBS/.download.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM
chmod 1777 "$TMP"

fetched=0 skipped=0 missing=""
for pkg in $PACKAGES; do
    stamp=$DEBS/$pkg.extracted
    if [ -f "$stamp" ]; then
        skipped=$((skipped + 1))
        continue
    fi
    deb=$(ls "$DEBS/${pkg}_"*.deb 2>/dev/null | head -n 1 || true)
    if [ -z "$deb" ]; then
        if ! (cd "$TMP" && apt-get download -qq "$pkg" 2>&1 | grep -v "unsandboxed" >&2;
              ls "${pkg}_"*.deb >/dev/null 2>&1); then
            say "warning: cannot download $pkg; continuing without it"
            missing="$missing $pkg"
            continue
        fi
        deb=$(ls "$TMP/${pkg}_"*.deb | head -n 1)
        mv "$deb" "$DEBS/"
        deb=$DEBS/$(basename "$deb")
    fi
    dpkg-deb -x "$deb" "$EXTRACTED"
    : > "$stamp"
    fetched=$((fetched + 1))
done

if [ $((fetched + skipped)) -eq 0 ]; then
    say "no font package could be downloaded; put font files in data/fonts/ yourself" \
        "and run \`make data-glyphs FONTS=data/fonts\`"
    exit 1
fi
say "$fetched package(s) fetched, $skipped already there, fonts in" \
    "$EXTRACTED${missing:+ (unavailable:$missing)}"
