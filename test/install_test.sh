#!/bin/sh
# Installs into a temporary prefix and builds the examples against the
# installed header, library and memtrain.pc, as a user would.
set -eu
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
make --no-print-directory install PREFIX="$tmp" BUILD="${BUILD:-build}" >/dev/null
export PKG_CONFIG_PATH="$tmp/lib/pkgconfig"
for ex in embed custom_allocator; do
    cc -std=c11 -Wall -Wextra -Werror ${SAN_FLAGS:-} "examples/$ex.c" $(pkg-config --cflags --libs memtrain) -o "$tmp/$ex"
    "$tmp/$ex" >/dev/null
done
"$tmp/bin/memtrain" --version >/dev/null
echo "ok   install tests"
