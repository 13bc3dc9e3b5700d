#!/usr/bin/env bash
# bundle.sh - makes the offline GPU bundle (`make gpu-bundle` runs it):
#
#   gpu/bundle.sh OUT_DIR BIN... -- STAND_IN...
#
# OUT_DIR/memtrain-gpu/ gets bin/ (the programs BIN..., linked with an
# $ORIGIN rpath, and with STACKS=PATH the static stack sampler
# gpu/stacks.c as bin/mt_stacks), stand-in/ (the test suite's stand-in driver and cuBLASLt,
# for run.sh --stand-in), lib/ (every shared library they need that is neither
# glibc nor the NVIDIA driver, found with ldd), lib/fallback/ (the
# compiler's C++ and GCC runtimes: used only where the machine has none,
# since ours may want a newer glibc than the machine's), run.sh, the Python
# side of the GPT-2 comparison, golden/ (the test suite's golden files, which
# the engine tests read; run.sh sets MT_GOLDEN_DIR to them), and MANIFEST (what was built, from which
# commit, the newest glibc symbol version anything needs). Then, unless
# BUNDLE_TAR=0, OUT_DIR/memtrain-gpu.tar.gz, which must stay within
# BUNDLE_MAX_MIB (48).
set -euo pipefail

OUT=${1:?usage: gpu/bundle.sh OUT_DIR BIN...}
shift
NAME=memtrain-gpu
DIR=$OUT/$NAME
MAX_MIB=${BUNDLE_MAX_MIB:-48}
rm -rf "$DIR" "$OUT/$NAME.tar.gz"
mkdir -p "$DIR/bin" "$DIR/lib/fallback" "$DIR/bench" "$DIR/stand-in" "$DIR/golden"
BINS=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do BINS+=("$1"); shift; done
[ $# -gt 0 ] && shift
cp "$@" "$DIR/stand-in/"

# libraries never carried: glibc's (the machine's must serve), and the
# driver's (it must match the machine's kernel module)
skip_lib() {
    case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libdl.so* | libpthread.so* | \
        librt.so* | libresolv.so* | libutil.so* | libmvec.so*) return 0 ;;
    libcuda.so* | libnvidia-*.so* | libcudadebugger.so*) return 0 ;;
    esac
    return 1
}
# the toolchain's runtimes: carried as a fallback only
fallback_lib() {
    case "$1" in libstdc++.so* | libgcc_s.so*) return 0 ;; esac
    return 1
}

for b in "${BINS[@]}" "$DIR"/stand-in/*; do
    case "$b" in "$DIR"/*) ;; *) cp "$b" "$DIR/bin/" ;; esac
    # every library the program loads at start, the indirect ones included
    ldd "$b" | awk '/=> \// {print $1, $3}' | while read -r soname path; do
        skip_lib "$soname" && continue
        if fallback_lib "$soname"; then dest=$DIR/lib/fallback; else dest=$DIR/lib; fi
        [ -e "$dest/$soname" ] || cp -L "$path" "$dest/$soname"
    done
    if ldd "$b" | grep -q "not found"; then
        echo "bundle.sh: $b needs a library ldd cannot find:" >&2
        ldd "$b" | grep "not found" >&2
        exit 1
    fi
done
strip --strip-debug "$DIR"/bin/* "$DIR"/stand-in/* 2>/dev/null || true
# the stack sampler run.sh uses where gdb is missing: static, so no ldd
if [ -n "${STACKS:-}" ]; then cp "$STACKS" "$DIR/bin/mt_stacks"; fi

cp gpu/run.sh "$DIR/run.sh"
cp bench/torch_gpt2.py bench/gpt2_tools.py "$DIR/bench/"
cp test/golden/*.gv test/golden/*.bin test/golden/MANIFEST.txt "$DIR/golden/"
chmod +x "$DIR/run.sh"

# (objdump fails on the static mt_stacks, which needs no glibc of the machine's)
glibc=$({ objdump -T "$DIR"/bin/* "$DIR"/lib/*.so* 2>/dev/null || true; } | grep -o 'GLIBC_[0-9][0-9.]*' |
    sed 's/GLIBC_//' | sort -uV | tail -n1)
{
    echo "memtrain GPU bundle"
    echo "commit: $(git describe --always --dirty 2>/dev/null || echo unknown)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -sr), $(${CC:-cc} --version | head -n1)"
    echo "nvcc: $( (${NVCC:-nvcc} --version 2>/dev/null || true) | tail -n1)"
    echo "needs glibc: $glibc"
    echo "programs: $(cd "$DIR/bin" && echo *)"
    echo "libraries: $(cd "$DIR/lib" && ls | grep -v fallback | tr '\n' ' ')"
    echo "fallback libraries: $(cd "$DIR/lib/fallback" && echo *)"
} > "$DIR/MANIFEST"

if [ "${BUNDLE_TAR:-1}" = 0 ]; then # the folder alone (make test)
    echo "gpu bundle folder: $DIR"
    exit 0
fi
tar -C "$OUT" -czf "$OUT/$NAME.tar.gz" "$NAME"
size=$(stat -c %s "$OUT/$NAME.tar.gz")
mib=$(((size + 1048575) / 1048576))
echo "gpu bundle: $OUT/$NAME.tar.gz, $mib MiB (limit $MAX_MIB); folder $DIR"
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "bundle.sh: the tarball is $mib MiB, over the $MAX_MIB MiB limit" >&2
    exit 1
fi
