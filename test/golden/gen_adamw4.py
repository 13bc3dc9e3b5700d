#!/usr/bin/env python3
"""
gen_adamw4.py - golden vectors for the 4-bit AdamW op of memtrain's op
table (lib/ops/kernels.h: adamw4).

Run from the repository root with a Python that has torch and numpy (the
.gv writer is gen.py's, imported):

    /tmp/venv-torch/bin/python test/golden/gen_adamw4.py

It writes adamw4.gv into test/golden/ and its own section of MANIFEST.txt.
The C side is test/test_optim4.c.

The reference is an independent numpy model, in fp32 operation by
operation, of the algorithm of Li, Chen and Zhu, "Memory Efficient
Optimizers with 4-bit States" (NeurIPS 2023), as its public code (lpmm)
runs it by default and lib/ops/kernels.h states it. Their code is a CUDA
extension and is not run here. The model:
  - the maps: the first moment's is lpmm's dynamic-exponent map of 4 bits
    (create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4),
    restated below with torch's fp32 linspace), the second moment's the
    linear map without zero (linspace(0, 1, 17) without its 0);
  - per step t: g = g * gs; m and v dequantized (code value * scale); a
    non-finite g makes m = v = 0 and leaves p alone (memtrain's rule; lpmm
    has none); else m = b1 m + (1 - b1) g, v = b2 v + ((1 - b2) g) g,
    p = p (1 - lr wd) - lr / (1 - b1^t) * (m / (sqrt(v) / sqrt(1 - b2^t)
    + eps)), the scalars made in double and rounded to fp32;
  - m: blocks of 128, absmax = max |m|, code = the number of fp32
    midpoints (c[k] + c[k+1]) * 0.5 strictly below m / absmax (0 / 0: the
    code of 0); v of a matrix: scale = min(row max, column max) of the new
    v; of a vector: blocks of 128 with their max; code likewise (scale 0:
    code 0);
  - two codes per byte, the first in the low nibble; an odd count pads
    with 7 (m) and 0 (v), the codes of a fresh state.
Cases: a 24 x 40 matrix (rank-1 v; 960 elements, the last m block partial)
with gradients spread over five decades, a row and a column of zero
gradients, and an infinite gradient at step 2; a vector of 301 elements;
4 steps each, every step's parameters and state stored.

File format: see gen.py.
"""

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen  # noqa: E402

MANIFEST_MARK = "# 4-bit AdamW reference, written by gen_adamw4.py"
F = np.float32
BLK = 128


def maps():
    """lpmm's two 4-bit maps, made as its code makes them."""
    vals = []
    for i in range(3):
        b = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (b[:-1] + b[1:]) / 2.0
        scale = 10 ** (-2 + i)
        vals += (scale * means).tolist() + (-scale * means).tolist()
    vals += [0.0, 1.0]
    signed = np.array(sorted(vals), dtype=F)
    unsigned = torch.linspace(0, 1, 17, dtype=torch.float32)[1:].numpy().astype(F)
    assert len(signed) == 16 and signed[7] == 0
    return signed, unsigned


CODE_M, CODE_V = maps()
MID_M = ((CODE_M[:-1] + CODE_M[1:]) * F(0.5)).astype(F)
MID_V = ((CODE_V[:-1] + CODE_V[1:]) * F(0.5)).astype(F)


def unpack(q, n):
    out = np.empty(2 * q.shape[0], np.int64)
    out[0::2] = q & 15
    out[1::2] = q >> 4
    return out[:n]


def pack(c, pad):
    if c.shape[0] % 2:
        c = np.concatenate([c, [pad]])
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def codes_of(x, scale, mid, zero):
    with np.errstate(divide="ignore", invalid="ignore"):
        y = (x / scale).astype(F)
    c = (y[:, None] > mid[None, :]).sum(1)
    return np.where(scale == 0, zero, c)


def step(st, g, t, lr, b1, b2, eps, wd, gs=1.0):
    p, qm, am, qv, sv = st["p"], st["qm"], st["am"], st["qv"], st["sv"]
    rows, cols, rank1 = st["rows"], st["cols"], st["rank1"]
    n = rows * cols
    idx = np.arange(n)
    blk = idx // BLK
    r, c = idx // cols, idx % cols
    b1f, b2f, epsf = F(b1), F(b2), F(eps)
    c1, c2 = F(1) - b1f, F(1) - b2f
    gv = (g * F(gs)).astype(F)
    keep = np.isfinite(gv)
    with np.errstate(over="ignore", invalid="ignore"):
        m = (b1f * (CODE_M[unpack(qm, n)] * am[blk]) + c1 * gv).astype(F)
        scale = np.minimum(sv[r], sv[rows + c]) if rank1 else sv[blk]
        v = (b2f * (CODE_V[unpack(qv, n)] * scale) + (c2 * gv) * gv).astype(F)
    m = np.where(keep, m, F(0)).astype(F)
    v = np.where(keep, v, F(0)).astype(F)
    lr32, wd32 = float(F(lr)), float(F(wd))
    step_size = F(lr32 / (1.0 - float(b1f) ** t))
    bc2_sqrt = F(np.sqrt(1.0 - float(b2f) ** t))
    decay = F(1.0 - lr32 * wd32)
    denom = (np.sqrt(v) / bc2_sqrt + epsf).astype(F)
    pn = (p * decay - step_size * (m / denom)).astype(F)
    p = np.where(keep, pn, p).astype(F)
    nb = (n + BLK - 1) // BLK
    am = np.array([np.abs(m[b * BLK:(b + 1) * BLK]).max() for b in range(nb)], F)
    if rank1:
        vv = v.reshape(rows, cols)
        sv = np.concatenate([vv.max(1), vv.max(0)]).astype(F)
        s = np.minimum(sv[r], sv[rows + c])
    else:
        sv = np.array([v[b * BLK:(b + 1) * BLK].max() for b in range(nb)], F)
        s = sv[blk]
    qm = pack(codes_of(m, am[blk], MID_M, 7), 7)
    qv = pack(codes_of(v, s, MID_V, 0), 0)
    st.update(p=p, qm=qm, am=am, qv=qv, sv=sv)


def case(gvf, name, rows, cols, rank1, grads, p0, hp):
    n = rows * cols
    nb = (n + BLK - 1) // BLK
    st = dict(p=p0.copy(), qm=np.full((n + 1) // 2, 0x77, np.uint8), am=np.zeros(nb, F),
              qv=np.zeros((n + 1) // 2, np.uint8),
              sv=np.zeros(rows + cols if rank1 else nb, F), rows=rows, cols=cols, rank1=rank1)
    gvf.add(name + ".shape", torch.tensor([rows, cols, rank1], dtype=torch.int32))
    gvf.add(name + ".p0", torch.from_numpy(p0))
    gvf.add(name + ".grads", torch.from_numpy(grads))
    for t in range(1, grads.shape[0] + 1):
        step(st, grads[t - 1], t, **hp)
        for k in ("p", "qm", "am", "qv", "sv"):
            gvf.add("%s.t%d.%s" % (name, t, k), torch.from_numpy(np.ascontiguousarray(st[k])))


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(4)
    hp = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=0.01)
    gvf = gen.Golden("adamw4", 4, "lr=1e-3 betas=0.9,0.999 eps=1e-8 wd=0.01 block=128")
    gvf.add("map_m", torch.from_numpy(CODE_M))
    gvf.add("map_v", torch.from_numpy(CODE_V))
    gvf.add("hp", torch.tensor([hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["wd"]],
                               dtype=torch.float32))

    rows, cols, steps = 24, 40, 4
    n = rows * cols
    spread = np.exp(rng.uniform(np.log(1e-5), 0, (steps, n))).astype(F)
    g = (rng.standard_normal((steps, n)).astype(F) * spread).astype(F)
    g = g.reshape(steps, rows, cols)
    g[:, 5, :] = 0       # a row of zero gradients: its scale is 0
    g[:, :, 9] = 0       # and a column
    g = g.reshape(steps, n)
    g[1, 77] = np.inf    # a non-finite gradient at step 2
    p0 = rng.standard_normal(n).astype(F)
    case(gvf, "mat", rows, cols, 1, g.astype(F), p0, hp)

    n = 301
    g = (rng.standard_normal((steps, n)) * np.exp(rng.uniform(-8, 0, (steps, n)))).astype(F)
    p0 = rng.standard_normal(n).astype(F)
    case(gvf, "vec", 1, n, 0, g, p0, hp)
    gvf.write()
    total = gen.update_section(MANIFEST_MARK, "numpy model of lpmm's default AdamW (4-bit)", [])
    assert total < 120_000, total


if __name__ == "__main__":
    main()
