#!/usr/bin/env python3
"""
gpt2_tools.py - the helpers of bench/gpt2_side_by_side.sh.

    python bench/gpt2_tools.py tokens FILE [--n N] [--vocab V] [--seed S]
    python bench/gpt2_tools.py report RUNDIR --mode side|ckpt|long|cpu [--md]

tokens: writes an llm.c token file (256 int32 header [0] 20240520, [1] 1,
[2] N, then N uint16 tokens) of synthetic text with structure a model can
learn, so that losses fall during a run: token ranks follow a Zipf law
(exponent 1.1) over a random permutation of the vocabulary, and each token
has 4 fixed successors (drawn from the same law); the next token is one of
the current token's successors with probability 0.7, else a fresh draw.
Deterministic for a given --seed (numpy's PCG64).

report: reads the JSON lines the runs of a section left in RUNDIR (one file
per run, <tag>.<impl>.r<round>.json, or .err when the run failed) and
prints the section's tables as Markdown. Where a run was repeated over
rounds, the round with the lowest median ms/step stands for it (the one the
rest of a shared machine disturbed least); the per-round ratios are shown
beside it.
"""

import argparse
import glob
import json
import os
import statistics
import sys

TOKENS_MAGIC, TOKENS_VERSION, HEADER_INTS = 20240520, 1, 256


def make_tokens(a):
    import numpy as np

    rng = np.random.default_rng(a.seed)
    V, n = a.vocab, a.n
    perm = rng.permutation(V)
    w = 1.0 / np.arange(1, V + 1) ** 1.1
    cdf = np.cumsum(w / w.sum())

    def draw(k):
        return perm[np.minimum(np.searchsorted(cdf, rng.random(k)), V - 1)]

    succ = draw(V * 4).reshape(V, 4)
    fresh = draw(n)
    follow = rng.random(n) < 0.7
    pick = rng.integers(0, 4, n)
    out = np.empty(n, dtype=np.int64)
    cur = int(fresh[0])
    for i in range(n):
        if follow[i]:
            cur = int(succ[cur, pick[i]])
        else:
            cur = int(fresh[i])
        out[i] = cur
    hdr = np.zeros(HEADER_INTS, dtype="<i4")
    hdr[:3] = [TOKENS_MAGIC, TOKENS_VERSION, n]
    tmp = a.file + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(hdr.tobytes())
        fh.write(out.astype("<u2").tobytes())
    os.replace(tmp, a.file)


# ---- reading runs ----

def load_round(base):
    """The JSON of one run, {"error": ...} when it failed, None if not run."""
    if os.path.exists(base + ".json"):
        with open(base + ".json") as fh:
            lines = [l for l in fh.read().splitlines() if l.startswith("{")]
        if lines:
            return json.loads(lines[-1])
    if os.path.exists(base + ".err"):
        with open(base + ".err") as fh:
            text = fh.read().strip().splitlines()
        msg = next((l for l in text if l.startswith("unsupported:")), None)
        if msg:
            return {"error": "unsupported", "message": msg}
        return {"error": "failed", "message": text[-1] if text else "no output"}
    return None


def load_rounds(rundir, tag, impl):
    """Every round of a run, in round order (None where a round lacks it)."""
    out, r = [], 1
    while True:
        base = os.path.join(rundir, "%s.%s.r%d" % (tag, impl, r))
        if not (os.path.exists(base + ".json") or os.path.exists(base + ".err")):
            if not glob.glob(os.path.join(rundir, "*.r%d.*" % r)):
                return out
            out.append(None)
        else:
            out.append(load_round(base))
        r += 1


def load(rundir, tag, impl):
    """The run's best round (lowest median ms/step), or its failure."""
    rs = [x for x in load_rounds(rundir, tag, impl) if x is not None]
    good = [x for x in rs if "error" not in x]
    if good:
        return min(good, key=lambda x: x["ms_per_step_median"])
    return rs[0] if rs else None


def runs_order(rundir):
    path = os.path.join(rundir, "order.txt")
    with open(path) as fh:
        return [l.split("\t") for l in fh.read().splitlines() if l.strip()]


def f1(x):
    return "%.1f" % x


def ratio(a, b):
    return "%.2fx" % (a / b) if a is not None and b else "-"


def cell_err(r):
    if r is None:
        return "not run"
    return r["error"]


def max_loss_diff(a, b):
    n = min(len(a["losses"]), len(b["losses"]))
    return max(abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]))


def gemm_rates(rundir):
    rates = []
    for tag in ("gemm_start", "gemm_end"):
        rates += [r for r in load_rounds(rundir, tag, "onednn") if r and "gflops" in r]
    return rates


# ---- the side-by-side section ----

def report_side(rundir):
    rows = runs_order(rundir)
    base = load(rundir, "a_fp32_adamw", "memtrain")
    tbase = load(rundir, "a_fp32_adamw", "pytorch")
    ok = lambda r: r is not None and "error" not in r

    print("| config | memtrain flags | PyTorch flags | ours ms/step | PyTorch ms/step | "
          "ours / PyTorch | ours peak RSS MiB | PyTorch peak RSS MiB | ours / PyTorch | "
          "ours added MiB | PyTorch added MiB | max loss diff | ms/step ratio per round |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tag, label, ours_flags, torch_flags in rows:
        o, t = load(rundir, tag, "memtrain"), load(rundir, tag, "pytorch")
        cells = [label, "`%s`" % ours_flags if ours_flags else "(defaults)",
                 "`%s`" % torch_flags if torch_flags else "(defaults)"]
        oms = o["ms_per_step_median"] if ok(o) else None
        tms = t["ms_per_step_median"] if ok(t) else None
        orss = o["peak_rss_mib"] if ok(o) else None
        trss = t["peak_rss_mib"] if ok(t) else None
        cells += [f1(oms) if ok(o) else cell_err(o), f1(tms) if ok(t) else cell_err(t),
                  ratio(oms, tms)]
        cells += [f1(orss) if ok(o) else cell_err(o), f1(trss) if ok(t) else cell_err(t),
                  ratio(orss, trss)]
        cells += [f1(orss - o["rss_before_model_mib"]) if ok(o) else "-",
                  f1(trss - t["rss_before_model_mib"]) if ok(t) else "-"]
        cells += ["%.2g" % max_loss_diff(o, t) if ok(o) and ok(t) else "-"]
        per = [ratio(a["ms_per_step_median"], b["ms_per_step_median"]) if ok(a) and ok(b) else "-"
               for a, b in zip(load_rounds(rundir, tag, "memtrain"),
                               load_rounds(rundir, tag, "pytorch"))]
        cells += [", ".join(per) if per else "-"]
        print("| " + " | ".join(cells) + " |")

    print()
    print("Against our own fp32 AdamW baseline (the library's accounted peak is the peak "
          "of live bytes over all classes together; reserved is what the allocators held):")
    print()
    print("| config | ours ms/step / baseline | peak RSS MiB | RSS / baseline | accounted peak "
          "MiB | accounted / baseline | reserved peak MiB | PARAM | MASTER | GRAD | OPTIM | "
          "ACT | WORK | IO |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tag, label, _, _ in rows:
        o = load(rundir, tag, "memtrain")
        if not ok(o) or not ok(base):
            print("| %s | %s |%s" % (label, cell_err(o) if not ok(o) else "-", " - |" * 12))
            continue
        pc = o["mem_peak_mib"]
        cells = [label, ratio(o["ms_per_step_median"], base["ms_per_step_median"]),
                 f1(o["peak_rss_mib"]), ratio(o["peak_rss_mib"], base["peak_rss_mib"]),
                 f1(o["mem_peak_live_mib"]),
                 ratio(o["mem_peak_live_mib"], base["mem_peak_live_mib"]),
                 f1(o["mem_peak_reserved_mib"])]
        cells += [f1(pc[c]) for c in ("PARAM", "MASTER", "GRAD", "OPTIM", "ACT", "WORK", "IO")]
        print("| " + " | ".join(cells) + " |")

    rates = gemm_rates(rundir)
    if ok(base) and rates:
        print()
        best = max(rates, key=lambda r: r["gflops"])
        rate = best["gflops"]
        P = base["params"]
        N = base["B"] * base["T"]
        ideal_ms = 6.0 * P * N / (rate * 1e9) * 1e3
        print("Roofline: oneDNN fp32 matmul at this step's GEMM shapes, %d threads "
              "(`bench_gpt2 --gemm`, at the start and the end of each round): %s GFLOP/s; "
              "the best, %.1f, is used (%s)." % (
                  rates[0]["threads"], ", ".join("%.1f" % r["gflops"] for r in rates), rate,
                  rates[0]["onednn"]))
        print()
        print("| quantity | value |")
        print("|---|---|")
        print("| params P | %d |" % P)
        print("| tokens per step N = B x T | %d |" % N)
        print("| 6 P N / GEMM rate | %.1f ms |" % ideal_ms)
        print("| oneDNN time for this step's GEMMs alone | %.1f ms (%.1f GFLOP) |"
              % (best["step_gemm_ms"], best["step_gemm_gflop"]))
        print("| ours, fp32 AdamW, ms/step | %.1f |" % base["ms_per_step_median"])
        print("| ours / (6 P N / rate) | %.2fx |" % (base["ms_per_step_median"] / ideal_ms))
        if ok(tbase):
            print("| PyTorch / (6 P N / rate) | %.2fx |" % (tbase["ms_per_step_median"] / ideal_ms))


# ---- the checkpointing section ----

def report_ckpt(rundir):
    rows = runs_order(rundir)
    none = load(rundir, "ck_none", "memtrain")
    ok = lambda r: r is not None and "error" not in r
    print("| recompute | ms/step | ms/step / none | per round | ACT peak MiB | ACT / none | "
          "accounted peak MiB | peak RSS MiB | loss, last step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tag, label, _, _ in rows:
        o = load(rundir, tag, "memtrain")
        if not ok(o) or not ok(none):
            print("| %s | %s |%s" % (label, cell_err(o), " - |" * 7))
            continue
        act, act0 = o["mem_peak_mib"]["ACT"], none["mem_peak_mib"]["ACT"]
        per = [ratio(a["ms_per_step_median"], b["ms_per_step_median"]) if ok(a) and ok(b) else "-"
               for a, b in zip(load_rounds(rundir, tag, "memtrain"),
                               load_rounds(rundir, "ck_none", "memtrain"))]
        print("| %s | %.1f | %s | %s | %.2f | %s | %.1f | %.1f | %.4f |" % (
            label, o["ms_per_step_median"],
            ratio(o["ms_per_step_median"], none["ms_per_step_median"]), ", ".join(per), act,
            ratio(act, act0), o["mem_peak_live_mib"], o["peak_rss_mib"], o["losses"][-1]))
    t0, t1 = load(rundir, "ck_none", "pytorch"), load(rundir, "ck_every1", "pytorch")
    if ok(t0) and ok(t1):
        print()
        print("PyTorch in the same run, for reference: torch.utils.checkpoint on every block "
              "(ours: every:1) %.1f ms/step against %.1f without, %s; peak RSS %.1f against "
              "%.1f MiB." % (t1["ms_per_step_median"], t0["ms_per_step_median"],
                              ratio(t1["ms_per_step_median"], t0["ms_per_step_median"]),
                              t1["peak_rss_mib"], t0["peak_rss_mib"]))


# ---- the 200-step loss comparison ----

def report_long(rundir):
    rows = runs_order(rundir)
    ok = lambda r: r is not None and "error" not in r
    base = load(rundir, "long_fp32", "memtrain")
    print("| run | impl | loss step 1 | loss step 100 | final loss (mean of last 10) | "
          "relative to ours fp32 | accounted peak MiB | peak RSS MiB | ms/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    final = lambda r: statistics.mean(r["losses"][-10:])
    for tag, label, impl, _ in rows:
        r = load(rundir, tag, impl)
        if not ok(r):
            print("| %s | %s | %s |%s" % (label, impl, cell_err(r), " - |" * 6))
            continue
        rel = "-"
        if ok(base) and not (tag == "long_fp32" and impl == "memtrain"):
            rel = "%+.3f%%" % (100.0 * (final(r) - final(base)) / final(base))
        ls = r["losses"]
        print("| %s | %s | %.4f | %.4f | %.4f | %s | %s | %.1f | %.1f |" % (
            label, impl, ls[0], ls[min(99, len(ls) - 1)], final(r), rel,
            f1(r["mem_peak_live_mib"]) if "mem_peak_live_mib" in r else "-",
            r["peak_rss_mib"], r["ms_per_step_median"]))


# ---- the CPU-speed section ----

# bench/op_profile.h's families, by op name
FAMILIES = [
    ("GEMM", ("matmul_fwd", "matmul_bwd", "matmul_dw_rows", "matmul_fwd_q", "matmul_dx_q")),
    ("optimizer update", ("sgd", "adamw", "adamw8", "adamw8_bf16", "adamw4", "adafactor")),
    ("casts", ("cast",)),
    ("attention", ("attention_fwd", "attention_bwd")),
    ("GELU", ("gelu_fwd", "gelu_bwd", "relu_fwd", "relu_bwd")),
    ("layernorm", ("layernorm_fwd", "layernorm_bwd")),
    ("residual add", ("add", "accumulate")),
    ("cross-entropy", ("xent", "xent_kd")),
    ("gradient check, sum of squares", ("unscale_check", "sumsq")),
    ("embedding", ("embedding_fwd", "embedding_bwd", "embedding_dw_rows", "embedding_fwd_q")),
]


def mean_ms(r):
    """The mean step (the profile's times are means), else the median."""
    return r.get("ms_per_step_mean", r["ms_per_step_median"])


def report_cpu(rundir):
    rows = runs_order(rundir)
    ok = lambda r: r is not None and "error" not in r
    base_rounds = load_rounds(rundir, "cpu_fp32", "memtrain")
    runs = []  # (label, impl, tag)
    for tag, label, _, torch_flags in rows:
        if tag in ("cpu_fp32", "cpu_bf16"):
            runs.append(("PyTorch, " + ("fp32 AdamW" if tag == "cpu_fp32" else "bf16 autocast"),
                         "pytorch", tag))
    for tag, label, _, _ in rows:
        runs.append(("memtrain, " + label, "memtrain", tag))
    print("| run | ms/step (best round) | per round | / our fp32 step, per round | "
          "peak RSS MiB | last loss |")
    print("|---|---|---|---|---|---|")
    for label, impl, tag in runs:
        rs = load_rounds(rundir, tag, impl)
        b = load(rundir, tag, impl)
        if not ok(b):
            print("| %s | %s | | | | |" % (label, cell_err(b)))
            continue
        per = ", ".join(f1(r["ms_per_step_median"]) if ok(r) else "-" for r in rs)
        rat = ", ".join(ratio(r["ms_per_step_median"], o["ms_per_step_median"])
                        if ok(r) and ok(o) else "-" for r, o in zip(rs, base_rounds))
        print("| %s | %s | %s | %s | %s | %.4f |" % (label, f1(b["ms_per_step_median"]), per, rat,
                                                     f1(b["peak_rss_mib"]), b["losses"][-1]))
    lean, recipe = (load_rounds(rundir, t, "memtrain") for t in ("cpu_lean", "cpu_recipe"))
    if any(ok(a) and ok(b) for a, b in zip(lean, recipe)):
        print()
        print("The lean step against fp32 with the lean recipe (the same work in fp32), per "
              "round: %s." % ", ".join(ratio(a["ms_per_step_median"], b["ms_per_step_median"])
                                       if ok(a) and ok(b) else "-"
                                       for a, b in zip(lean, recipe)))
    print()
    print("Our steps by op family (`--profile`, the best round; ms per step and share of the "
          "mean step, whose time is the last row):")
    print()
    ours = [(label, load(rundir, tag, "memtrain")) for tag, label, _, _ in rows]
    print("| op family | " + " | ".join(l for l, _ in ours) + " |")
    print("|---|" + "---|" * len(ours))
    # an op no family names (one added since) gets a row of its own, so the
    # families always add up to the ops' total
    known = {o for _, ops in FAMILIES for o in ops}
    extra = sorted({o for _, r in ours if ok(r) for o in r.get("profile_ms_per_step", {})} - known)
    for fam, ops in FAMILIES + [(o, (o,)) for o in extra]:
        cells = []
        for _, r in ours:
            if not ok(r) or "profile_ms_per_step" not in r:
                cells.append("-")
                continue
            ms = sum(r["profile_ms_per_step"].get(o, 0.0) for o in ops)
            cells.append("%.1f (%.1f%%)" % (ms, 100.0 * ms / mean_ms(r)))
        print("| %s | %s |" % (fam, " | ".join(cells)))
    cells = []
    for _, r in ours:
        if ok(r) and "profile_ops_ms_per_step" in r:
            rest = mean_ms(r) - r["profile_ops_ms_per_step"]
            cells.append("%.1f (%.1f%%)" % (rest, 100.0 * rest / mean_ms(r)))
        else:
            cells.append("-")
    print("| rest (engine) | %s |" % " | ".join(cells))
    print("| step (mean) | %s |" % " | ".join(f1(mean_ms(r)) if ok(r) else "-" for _, r in ours))
    rates = gemm_rates(rundir)
    base = load(rundir, "cpu_fp32", "memtrain")
    if rates and ok(base):
        best = max(rates, key=lambda r: r["gflops"])
        print()
        print("oneDNN fp32 matmul at this step's GEMM shapes (`bench_gpt2 --gemm`, start and "
              "end of each round): %s GFLOP/s; at the best, the step's GEMMs take %.1f ms; our "
              "fp32 step is %.2fx that." % (", ".join("%.1f" % r["gflops"] for r in rates),
                                            best["step_gemm_ms"],
                                            base["ms_per_step_median"] / best["step_gemm_ms"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("file")
    t.add_argument("--n", type=int, default=1 << 18)
    t.add_argument("--vocab", type=int, default=50257)
    t.add_argument("--seed", type=int, default=1234)
    r = sub.add_parser("report")
    r.add_argument("rundir")
    r.add_argument("--mode", choices=("side", "ckpt", "long", "cpu"), required=True)
    a = ap.parse_args()
    if a.cmd == "tokens":
        if not 1 < a.vocab <= 65536 or a.n < 2:
            sys.exit("need 1 < --vocab <= 65536 and --n >= 2")
        make_tokens(a)
    else:
        {"side": report_side, "ckpt": report_ckpt, "long": report_long,
         "cpu": report_cpu}[a.mode](a.rundir)


if __name__ == "__main__":
    main()
