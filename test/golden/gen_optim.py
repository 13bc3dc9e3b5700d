#!/usr/bin/env python3
"""
gen_optim.py - golden vectors for the 8-bit blockwise AdamW and the
Adafactor ops of memtrain's op table (lib/ops/kernels.h: adamw8, adafactor).

Run from the repository root with a Python that has torch, numpy,
bitsandbytes and transformers (the .gv writer is gen.py's, imported):

    /tmp/venv-torch/bin/pip install bitsandbytes transformers
    /tmp/venv-torch/bin/python test/golden/gen_optim.py

It writes adamw8.gv and adafactor.gv into test/golden/ and its own section
of MANIFEST.txt (replacing an earlier one, leaving the others). The C side
is test/test_optim.c.

adamw8.gv - the reference is NOT bitsandbytes' code run here. bitsandbytes'
8-bit blockwise AdamW is a CUDA kernel (kOptimizerStatic8bit2StateBlockwise);
its CPU backend (0.50) runs, but is another algorithm in the details: weight
decay before the step, no handling of non-finite gradients, and a
quantizer that is not nearest near 0 (it returns code 131, 2.1e-5, for
+-1e-9 against an absmax of 1). So the reference here is an independent
numpy model, in fp32 operation by operation, of the CUDA kernel as
lib/ops/kernels.h states it:
  - the maps are bitsandbytes' own: functional.create_dynamic_map(signed),
    stored as map_signed and map_unsigned (the C maps must equal them);
  - per element g = g gs; m, v dequantized (code value * block absmax);
    a non-finite g makes m = v = 0 and leaves p alone; else
    m = b1 m + (1 - b1) g, v = b2 v + ((1 - b2) g) g,
    p = (p + step_size (m / (sqrt(v) + eps_c2))) decay, with
    step_size = -lr sqrt(1 - b2^t) / (1 - b1^t), eps_c2 = eps sqrt(1 - b2^t),
    decay = 1 - lr wd, made in double and rounded to fp32;
  - absmax = max |m| (|v|) over the block; codes by the kernel's binary
    search (quantize_2D, restated below as q8_search) on m / absmax (IEEE
    division; the kernel's __fdividef is within 2 ulp of it), then the
    kernel's sign fix for m; a block whose absmax is 0 stores the zero code
    (the kernel divides 0 by 0 there and stores 255 for m; both decode to 0).
Where the gradients are finite, bitsandbytes' CPU backend is also run on the
same inputs and its parameters are stored as bnb.params: the C test checks
our parameters against them within a tolerance, and MANIFEST.txt records how
far they are from the reference.

Inputs of the cases are made by a small counter-based generator that the C
test repeats bit for bit (see urand below), so the large case stores only
outputs; the small cases also store their inputs, which the C test compares
with its own.

adafactor.gv - the reference is transformers.optimization.Adafactor itself,
run by torch on the CPU (one thread), with every hyperparameter rounded to
fp32 first (the op takes floats).

File format: see gen.py.
"""

import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen  # noqa: E402  (the .gv writer: gen.Golden)

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbf  # noqa: E402
import transformers  # noqa: E402
from transformers.optimization import Adafactor  # noqa: E402

MANIFEST_MARK = "# optimizer references, written by gen_optim.py"
VERSIONS = "bitsandbytes=%s transformers=%s" % (bnb.__version__, transformers.__version__)
BLOCK = 256
F = np.float32
notes = []


def f32(x):
    return float(np.float32(x))


# --------------------------------------------------------------- inputs --

M64 = (1 << 64) - 1


def mix64(z):
    """splitmix64's finaliser."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
    return z ^ (z >> 31)


def urand(seed, stream, n):
    """n fp32 values in [-1, 1): the top 24 bits of mix64(seed, stream, i)
    as (k - 2^23) / 2^23, exact in fp32. test_optim.c has the same."""
    base = (seed * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03) & M64
    out = np.empty(n, dtype=F)
    for i in range(n):
        k = mix64((base + i * 0x632BE59BD9B4E019) & M64) >> 40
        out[i] = F((k - (1 << 23)) / float(1 << 23))
    return out


def make_grads(seed, steps, n, gscale):
    """Gradients of step s (from 0): urand(seed, 1 + s) times gscale (1 + s)."""
    return np.stack([urand(seed, 1 + s, n) * F(gscale * (1 + s)) for s in range(steps)]).astype(F)


# ---------------------------------------------------- 8-bit AdamW model --

def q8_search(x, code, signed):
    """bitsandbytes' quantize_2D, restated for a vector: a binary search
    from pivot 127 in steps of 64 .. 1 keeping the bracketing codes, then
    the nearer of the last pivot and its neighbour by the fp32 midpoint."""
    n = x.shape[0]
    pivot = np.full(n, 127, dtype=np.int64)
    up_p = np.full(n, 255, dtype=np.int64)
    lo_p = np.zeros(n, dtype=np.int64)
    lower = np.full(n, F(-1.0) if signed else F(0.0), dtype=F)
    upper = np.full(n, F(1.0), dtype=F)
    val = code[pivot]
    i = 64
    while i > 0:
        gt = x > val
        lo_p = np.where(gt, pivot, lo_p)
        lower = np.where(gt, val, lower)
        up_p = np.where(gt, up_p, pivot)
        upper = np.where(gt, upper, val)
        pivot = np.where(gt, pivot + i, pivot - i)
        val = code[pivot]
        i >>= 1
    gt = x > val
    mid_hi = ((upper + val) * F(0.5)).astype(F)
    mid_lo = ((lower + val) * F(0.5)).astype(F)
    return np.where(gt, np.where(x > mid_hi, up_p, pivot),
                    np.where(x < mid_lo, lo_p, pivot))


def quantize(x, code, signed):
    """codes (uint8) and absmax (fp32) per block of x."""
    n = x.shape[0]
    q = np.empty(n, dtype=np.uint8)
    amax = np.empty((n + BLOCK - 1) // BLOCK, dtype=F)
    for b in range(amax.shape[0]):
        blk = x[b * BLOCK:(b + 1) * BLOCK]
        a = np.abs(blk)
        a = F(np.max(np.where(np.isnan(a), F(0), a)))
        amax[b] = a
        if a == 0:
            q[b * BLOCK:(b + 1) * BLOCK] = 127 if signed else 0
            continue
        r = q8_search((blk / a).astype(F), code, signed)
        if signed:
            flip = np.signbit(code[r]) != np.signbit(blk)
            r = np.where(flip, r + np.where(blk > 0, 1, -1), r) & 255
        q[b * BLOCK:(b + 1) * BLOCK] = r
    return q, amax


def adamw8_step(p, g, qm, qv, am, av, c, t, cs, cu):
    lr, b1, b2, eps, wd, gs = c["lr"], F(c["beta1"]), F(c["beta2"]), c["eps"], c["wd"], F(c["gs"])
    bc1 = 1.0 - math.pow(float(b1), t)
    bc2s = math.sqrt(1.0 - math.pow(float(b2), t))
    step_size, eps_c2 = F(-lr * bc2s / bc1), F(eps * bc2s)
    decay = F(1.0 - lr * wd)
    c1, c2 = F(1) - b1, F(1) - b2
    with np.errstate(invalid="ignore", over="ignore"):
        gv = (g * gs).astype(F)
        ok = np.isfinite(gv)
        mo = (cs[qm] * np.repeat(am, BLOCK)[:p.shape[0]]).astype(F)
        vo = (cu[qv] * np.repeat(av, BLOCK)[:p.shape[0]]).astype(F)
        m = (b1 * mo + c1 * gv).astype(F)
        v = (b2 * vo + (c2 * gv) * gv).astype(F)
        m[~ok] = 0
        v[~ok] = 0
        w = ((p + step_size * (m / (np.sqrt(v) + eps_c2))) * decay).astype(F)
    p = np.where(ok, w, p).astype(F)
    qm, am = quantize(m, cs, True)
    qv, av = quantize(v, cu, False)
    return p, qm, qv, am, av


def bnb_cpu_run(p0, grads, c, steps, cs, cu):
    """bitsandbytes' own CPU backend on the same inputs (finite only)."""
    n = p0.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    p = torch.tensor(p0)
    s1 = torch.zeros(n, dtype=torch.uint8)
    s2 = torch.zeros(n, dtype=torch.uint8)
    a1, a2 = torch.zeros(nb), torch.zeros(nb)
    q1, q2 = torch.tensor(cs), torch.tensor(cu)
    for t in range(1, steps + 1):
        bnbf.optimizer_update_8bit_blockwise(
            "adam", torch.tensor(grads[t - 1]), p, s1, s2, c["beta1"], c["beta2"], 0.0, 0.0,
            c["eps"], t, c["lr"], q1, q2, a1, a2, c["wd"], c["gs"], False)
    return p.numpy().copy()


def case_adamw8():
    cs = bnbf.create_dynamic_map(signed=True).numpy().astype(F)
    cu = bnbf.create_dynamic_map(signed=False).numpy().astype(F)
    gvf = gen.Golden("adamw8", 1000, "reference=numpy_model_of_bnb_cuda_kernel " + VERSIONS)
    gvf.add("map_signed", torch.tensor(cs))
    gvf.add("map_unsigned", torch.tensor(cu))
    steps = 5
    # n, seed, hyperparameters, gradient scale per step, stored inputs,
    # where non-finite gradients go ((step, index, value)), blocks whose
    # gradients are all zero at every step
    cases = [
        dict(n=300, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, gs=1.0, gscale=0.1,
             store=True, saved=[1, 2, 5], bnb=True),
        dict(n=4357, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, gs=1.0, gscale=0.05,
             saved=[5]),
        dict(n=512, lr=1e-2, beta1=0.8, beta2=0.99, eps=1e-6, wd=0.1, gs=0.5, gscale=1e-6,
             saved=[1, 5], zero_blocks=[1], bnb=True),
        dict(n=700, lr=2e-3, beta1=0.9, beta2=0.995, eps=1e-8, wd=1e-2, gs=2.0, gscale=0.01,
             saved=[1, 4, 5], bad=[(0, 3, math.inf), (0, 260, -math.inf), (1, 3, math.nan),
                                   (2, 600, math.nan), (4, 699, math.inf)] +
             [(3, j, math.nan) for j in range(512, 700)]),
    ]
    gvf.scalar_i32("configs", len(cases))
    gvf.scalar_i32("steps", steps)
    for ci, c in enumerate(cases):
        for k in ("lr", "beta1", "beta2", "eps", "wd", "gs", "gscale"):
            c[k] = f32(c[k])
        n, seed = c["n"], 1000 + ci
        p = urand(seed, 0, n)
        grads = make_grads(seed, steps, n, c["gscale"])
        for b in c.get("zero_blocks", []):
            grads[:, b * BLOCK:(b + 1) * BLOCK] = 0
        for s, j, val in c.get("bad", []):
            grads[s, j] = val
        nb = (n + BLOCK - 1) // BLOCK
        qm = np.full(n, 127, dtype=np.uint8)
        qv = np.zeros(n, dtype=np.uint8)
        am, av = np.zeros(nb, dtype=F), np.zeros(nb, dtype=F)
        pre = "c%d." % ci
        gvf.scalar_i32(pre + "n", n)
        gvf.scalar_i32(pre + "seed", seed)
        for k in ("lr", "beta1", "beta2", "eps", "wd", "gs", "gscale"):
            gvf.scalar_f32(pre + k, c[k])
        zb = c.get("zero_blocks", [])
        gvf.add(pre + "zero_blocks", torch.tensor(zb or [-1], dtype=torch.int32))
        bad = c.get("bad", [])
        gvf.add(pre + "bad_at", torch.tensor([[s, j] for s, j, _ in bad] or [[-1, -1]],
                                             dtype=torch.int32))
        gvf.add(pre + "bad_val", torch.tensor([v for _, _, v in bad] or [0.0],
                                              dtype=torch.float32))
        if c.get("store"):
            gvf.add(pre + "p0", torch.tensor(p))
            gvf.add(pre + "grads", torch.tensor(grads))
        saved = c["saved"]
        gvf.add(pre + "saved", torch.tensor(saved, dtype=torch.int32))
        ps, qms, qvs, ams, avs = [], [], [], [], []
        p0 = p.copy()
        for t in range(1, steps + 1):
            p, qm, qv, am, av = adamw8_step(p, grads[t - 1], qm, qv, am, av, c, t, cs, cu)
            if t in saved:
                ps.append(p); qms.append(qm); qvs.append(qv)
            ams.append(am); avs.append(av)
        gvf.add(pre + "params", torch.tensor(np.stack(ps)))
        gvf.add(pre + "qm", torch.tensor(np.stack(qms)))
        gvf.add(pre + "qv", torch.tensor(np.stack(qvs)))
        gvf.add(pre + "absmax_m", torch.tensor(np.stack(ams)))
        gvf.add(pre + "absmax_v", torch.tensor(np.stack(avs)))
        if not bad:
            pb = bnb_cpu_run(p0, grads, c, steps, cs, cu)
            if c.get("bnb"):
                gvf.add(pre + "bnb.params", torch.tensor(pb[None]))
            step = np.abs(p - p0)
            d = np.abs(pb - p)
            notes.append("adamw8 c%d  %s bnb CPU vs reference, params after %d steps: max |diff| "
                         "%.3g (%.3g of the largest total step), %d/%d differ"
                         % (ci, "(stored)" if c.get("bnb") else "        ", steps, d.max(),
                            d.max() / step.max(), int((d > 0).sum()), n))
    gvf.write()


# ------------------------------------------------------------ Adafactor --

def case_adafactor():
    gvf = gen.Golden("adafactor", 1100, "reference=transformers.Adafactor " + VERSIONS)
    steps = 6
    # inputs: p0 = urand(seed, 0), gradients make_grads(seed, 6, n, 0.1)
    # with the first element of step 2's multiplied by 50
    cases = [
        # transformers' defaults: relative step, parameter scale, no first moment
        dict(shape=(19, 45), kw=dict()),
        # lr given, first moment, weight decay
        dict(shape=(23, 40), kw=dict(lr=1e-2, relative_step=False, scale_parameter=False,
                                     beta1=0.9, weight_decay=1e-2)),
        # a vector: unfactored second moment
        dict(shape=(300,), kw=dict()),
        dict(shape=(257,), kw=dict(lr=1e-3, relative_step=False, scale_parameter=False,
                                   beta1=0.9, weight_decay=0.1)),
        # warm-up, parameter scale with a first moment, a tight clip threshold
        dict(shape=(16, 33), kw=dict(warmup_init=True, beta1=0.9, clip_threshold=0.5)),
        # lr given with the parameter scale kept
        dict(shape=(4, 130), kw=dict(lr=1e-2, relative_step=False, scale_parameter=True)),
    ]
    gvf.scalar_i32("configs", len(cases))
    gvf.scalar_i32("steps", steps)
    saved = [1, 2, steps]
    gvf.add("saved", torch.tensor(saved, dtype=torch.int32))
    for ci, c in enumerate(cases):
        kw = dict(eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8, beta1=None,
                  weight_decay=0.0, scale_parameter=True, relative_step=True, warmup_init=False,
                  lr=None)
        kw.update(c["kw"])
        kw["eps"] = (f32(kw["eps"][0]), f32(kw["eps"][1]))
        for k in ("clip_threshold", "decay_rate", "weight_decay", "lr", "beta1"):
            if kw[k] is not None:
                kw[k] = f32(kw[k])
        shape, seed = c["shape"], 1100 + ci
        n = int(np.prod(shape))
        p = torch.nn.Parameter(torch.tensor(urand(seed, 0, n)).reshape(shape))
        grads = torch.tensor(make_grads(seed, steps, n, f32(0.1))).reshape(steps, *shape)
        grads[1].view(-1)[0] *= 50.0  # an outlier: the clip threshold acts
        opt = Adafactor([p], **kw)
        ps = []
        for s in range(steps):
            p.grad = grads[s].clone()
            opt.step()
            if s + 1 in saved:
                ps.append(p.detach().clone())
        st = opt.state[p]
        pre = "c%d." % ci
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        gvf.scalar_i32(pre + "rows", rows)
        gvf.scalar_i32(pre + "cols", cols)
        gvf.scalar_i32(pre + "factored", int(len(shape) == 2))
        gvf.scalar_f32(pre + "lr", kw["lr"] if kw["lr"] is not None else 0.0)
        gvf.scalar_f32(pre + "eps1", kw["eps"][0])
        gvf.scalar_f32(pre + "eps2", kw["eps"][1])
        gvf.scalar_f32(pre + "clip_threshold", kw["clip_threshold"])
        gvf.scalar_f32(pre + "decay_rate", kw["decay_rate"])
        gvf.scalar_f32(pre + "beta1", kw["beta1"] if kw["beta1"] is not None else 0.0)
        gvf.scalar_f32(pre + "weight_decay", kw["weight_decay"])
        gvf.scalar_i32(pre + "scale_parameter", int(kw["scale_parameter"]))
        gvf.scalar_i32(pre + "relative_step", int(kw["relative_step"]))
        gvf.scalar_i32(pre + "warmup_init", int(kw["warmup_init"]))
        gvf.scalar_i32(pre + "seed", seed)
        gvf.add(pre + "params", torch.stack(ps).reshape(len(saved), rows, cols))
        if len(shape) == 2:
            gvf.add(pre + "row", st["exp_avg_sq_row"])
            gvf.add(pre + "col", st["exp_avg_sq_col"])
        else:
            gvf.add(pre + "v", st["exp_avg_sq"].reshape(rows, cols))
        if kw["beta1"] is not None:
            gvf.add(pre + "m", st["exp_avg"].reshape(rows, cols))
    gvf.write()


def update_manifest():
    """Writes this script's section of MANIFEST.txt (gen.update_section)."""
    tail = ["# adamw8: the reference is a numpy model of bitsandbytes' CUDA kernel",
            "# (see gen_optim.py); bitsandbytes' CPU backend differs from it thus:", ""] + notes
    return gen.update_section(MANIFEST_MARK, VERSIONS, tail)


def main():
    torch.set_num_threads(1)
    case_adamw8()
    case_adafactor()
    total = update_manifest()
    assert total < 160_000, total


if __name__ == "__main__":
    main()
