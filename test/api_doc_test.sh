#!/bin/sh
# Every function the public headers declare is listed in docs/api.md.
set -u
cd "$(dirname "$0")/.."
fail=0
for n in $(grep -ohE '^[a-z][a-z0-9_ *]*\bmt_[a-z0-9_]+\(' include/memtrain.h include/memtrain/allocator.h \
           include/memtrain/comm.h include/memtrain/mpi.h |
           grep -oE 'mt_[a-z0-9_]+\($' | tr -d '(' | sort -u); do
    grep -q "\`$n\`" docs/api.md || { echo "FAIL api doc: $n is not in docs/api.md"; fail=1; }
done
if [ $fail = 0 ]; then echo "ok   api doc lists every public function"; fi
exit $fail
