#!/bin/sh
# Every function the public headers declare is listed in docs/api.md, and the
# docs and headers stand on their own.
set -u
cd "$(dirname "$0")/.."
fail=0
for n in $(grep -ohE '^[a-z][a-z0-9_ *]*\bmt_[a-z0-9_]+\(' include/memtrain.h include/memtrain/allocator.h \
           include/memtrain/comm.h include/memtrain/mpi.h |
           grep -oE 'mt_[a-z0-9_]+\($' | tr -d '(' | sort -u); do
    grep -q "\`$n\`" docs/api.md || { echo "FAIL api doc: $n is not in docs/api.md"; fail=1; }
done
if [ $fail = 0 ]; then echo "ok   api doc lists every public function"; fi
# The docs and headers are self-contained: nothing points outside the
# repository, and the llm.c formats the library reads are written out.
docs_fail=0
if grep -n '\.\./shared' README.md docs/*.md include/memtrain.h include/memtrain/*.h; then
    echo "FAIL docs: the lines above point outside the repository"; docs_fail=1
fi
for c in LLMC_MAGIC LLMC_TOKENS_MAGIC; do
    v=$(grep -ohE "#define $c [0-9]+" lib/*.c lib/*/*.c | awk '{print $3}')
    [ -n "$v" ] && grep -q "$v" docs/formats.md ||
        { echo "FAIL docs: $c ($v) is not in docs/formats.md"; docs_fail=1; }
done
if [ $docs_fail = 0 ]; then echo "ok   docs are self-contained"; else fail=1; fi
exit $fail
