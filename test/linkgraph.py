#!/usr/bin/env python3
"""linkgraph.py - the library's link graph: which object uses a global
symbol which other object defines (nm), and its circles (strongly connected
components of more than one object).

    test/linkgraph.py BUILD_DIR [--edges] [OBJECT.o ...]

Prints each circle with the symbols that close it (--edges: every edge
inside each circle). The objects are those given (make test gives the
library's), else every object under BUILD_DIR/obj/{lib,kernels,allocators}. Exits 1 when a circle is not one of ALLOWED below, or
is larger than its entry: the layers call downwards only, and a new circle
is a layering mistake to fix, not to list. ALLOWED holds the deliberate
ones (the estimate runs the trainer dry) and those not broken yet, each
with its files; an entry goes when its circle does (docs/design.md,
"Layers").
"""
import collections
import glob
import os
import subprocess
import sys

# circles allowed, as sets of objects (paths under the build's obj/, without .o)
ALLOWED = [
    # the estimate creates a trainer on a dry context, and the trainer asks
    # the estimate for its recompute plan within a budget: deliberate
    {"lib/engine/estimate", "lib/engine/plan", "lib/train/trainer"},
]


def graph(build, objs):
    if not objs:
        for d in ("lib", "kernels", "allocators"):
            objs += glob.glob(os.path.join(build, "obj", d, "**", "*.o"), recursive=True)
    if not objs:
        sys.exit("linkgraph.py: no objects under %s/obj (build the library first)" % build)
    defs, uses = {}, collections.defaultdict(set)
    for o in sorted(objs):
        name = os.path.relpath(o, os.path.join(build, "obj"))[:-2]
        out = subprocess.run(["nm", "-g", o], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            f = line.split()
            if len(f) == 3 and f[1] in "TDBRVWC":
                defs[f[2]] = name
            elif len(f) == 2 and f[0] == "U":
                uses[name].add(f[1])
        uses.setdefault(name, set())
    edges = collections.defaultdict(lambda: collections.defaultdict(list))
    for a, syms in uses.items():
        for s in syms:
            b = defs.get(s)
            if b and b != a:
                edges[a][b].append(s)
    return sorted(uses), edges


def circles(nodes, edges):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        work = [(v, iter(sorted(edges[v])))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            u, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[u] = min(low[u], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[u])
            if low[u] == index[u]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == u:
                        break
                if len(comp) > 1:
                    out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: linkgraph.py BUILD_DIR [--edges] [OBJECT.o ...]")
    nodes, edges = graph(sys.argv[1], [a for a in sys.argv[2:] if a.endswith(".o")])
    found = circles(nodes, edges)
    bad = 0
    for c in sorted(found, key=lambda c: (-len(c), sorted(c))):
        ok = any(c <= a for a in ALLOWED)
        bad += not ok
        print("%s circle of %d: %s" % ("allowed" if ok else "NEW", len(c), " ".join(sorted(c))))
        if "--edges" in sys.argv or not ok:
            for a in sorted(c):
                for b in sorted(edges[a]):
                    if b in c:
                        print("    %s -> %s: %s" % (a, b, " ".join(sorted(edges[a][b])[:4])))
    print("%d objects, %d in circles, %d circle(s) not allowed" %
          (len(nodes), sum(len(c) for c in found), bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
