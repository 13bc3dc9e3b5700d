#!/usr/bin/env python3
"""
gen_sparse.py - golden vectors for memtrain's pruning masks
(lib/sparse/sparse.h): which weights magnitude, Wanda and N:M pruning keep.

Run from the repository root with a Python that has torch and numpy (the
.gv writer is gen.py's, imported):

    /tmp/venv-torch/bin/pip install torch numpy
    /tmp/venv-torch/bin/python test/golden/gen_sparse.py

It writes sparse.gv into test/golden/ and its own section of MANIFEST.txt.
The C side is test/test_sparse.c.

The references:
  - torch.nn.utils.prune.l1_unstructured(module, "weight", amount) on one
    tensor, and prune.global_unstructured(..., pruning_method=
    prune.L1Unstructured, amount) over three: the masks torch makes;
  - Wanda (Sun et al. 2023), as the paper's code computes it: the row
    scaler ||X_j||^2 / nsamples accumulated over calibration batches
    (running mean), score |W| * sqrt(scaler), each row's
    int(cols * ratio) smallest pruned (a stable sort); with N:M, in each
    group of M consecutive columns of a row, the prune_n smallest scores
    pruned by topk;
  - N:M by magnitude as NVIDIA's ASP makes it (m4n2_1d and the like): in
    each group of M consecutive weights of a row, the N largest |w| kept.
Every case has distinct scores, with a relative gap between neighbours
far above fp32 rounding, so no tie and no order of summation decides.
Masks are stored as uint8 (1: kept), in the tensor's element order.
"""

import os
import sys

import numpy as np
import torch
import torch.nn.utils.prune as prune

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen  # noqa: E402

MANIFEST_MARK = "# pruning masks, written by gen_sparse.py"
F = np.float32


def distinct(g, rows, cols):
    """A (rows, cols) fp32 tensor whose magnitudes are distinct, spread over
    [0.05, 2], with random signs."""
    n = rows * cols
    mag = (torch.randperm(n, generator=g).float() + 1.0) / n * 1.95 + 0.05
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (mag * sign).reshape(rows, cols) if cols else (mag * sign)


def mask_u8(m):
    return m.detach().reshape(-1).to(torch.uint8)


def gaps_ok(score, per_row):
    """Neighbouring scores (in a row, or in the whole tensor) differ by more
    than 1e-5 relative: the C side's sums may round differently."""
    s = score.reshape(score.shape[0], -1) if per_row else score.reshape(1, -1)
    srt, _ = torch.sort(s.double(), dim=-1)
    gap = (srt[:, 1:] - srt[:, :-1]) / srt[:, 1:].clamp_min(1e-30)
    return gap.min().item() > 1e-5


def case_magnitude(gv, g):
    for name, rows, cols, amounts in (("l1_a", 40, 32, (0.5, 0.9, 0.3, 0.75)),
                                      ("l1_b", 5, 2, (0.25, 0.35, 0.05))):
        w = distinct(g, rows, cols)
        gv.add(name + ".w", w)
        for a in amounts:
            lin = torch.nn.Linear(cols, rows, bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            prune.l1_unstructured(lin, "weight", amount=a)
            gv.add("%s.mask_%g" % (name, a), mask_u8(lin.weight_mask))
    # global_unstructured over three tensors (a 1-D one among them)
    ws = [distinct(g, 32, 16), distinct(g, 24, 8), distinct(g, 40, 0)]
    mods = []
    for i, w in enumerate(ws):
        gv.add("glob.w%d" % i, w)
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(w.clone())
        mods.append(m)
    for a in (0.6, 0.25):
        ms = []
        for m in mods:
            mm = torch.nn.Module()
            mm.weight = torch.nn.Parameter(m.weight.detach().clone())
            ms.append(mm)
        prune.global_unstructured([(m, "weight") for m in ms], pruning_method=prune.L1Unstructured,
                                  amount=a)
        for i, m in enumerate(ms):
            gv.add("glob.mask_%g_%d" % (a, i), mask_u8(m.weight_mask))


def wanda_scaler(xs):
    """The paper's running mean of ||X_j||^2 over calibration batches (each
    (tokens, in)): scaler *= n / (n + 1); scaler += ||X_j||^2 / (n + 1)."""
    scaler = torch.zeros(xs[0].shape[1], dtype=torch.float32)
    nsamples = 0
    for x in xs:
        scaler *= nsamples / (nsamples + 1)
        nsamples += 1
        scaler += torch.norm(x.float(), p=2, dim=0) ** 2 / nsamples
    return scaler


def case_wanda(gv, g):
    rows, cols = 48, 64
    while True:  # drawn again until no two scores of a row are close
        w = distinct(g, rows, cols)
        # calibration: 3 batches of 20 tokens; column scales spread widely
        # so the activations change the ranking
        colscale = torch.exp(torch.linspace(-1.5, 1.5, cols))[torch.randperm(cols, generator=g)]
        xs = [torch.randn(20, cols, generator=g) * colscale for _ in range(3)]
        scaler = wanda_scaler(xs)
        score = torch.abs(w) * torch.sqrt(scaler.reshape(1, -1))
        if gaps_ok(score, per_row=True):
            break
    gv.add("wanda.w", w)
    for i, x in enumerate(xs):
        gv.add("wanda.x%d" % i, x)
    gv.add("wanda.score", score)
    for ratio in (0.5, 0.7):
        mask = torch.zeros_like(score, dtype=torch.bool)  # True: pruned
        idx = torch.sort(score, dim=-1, stable=True)[1][:, :int(cols * ratio)]
        mask.scatter_(1, idx, True)
        gv.add("wanda.mask_%g" % ratio, mask_u8(~mask))
    # the paper's N:M: prune_n of each prune_m pruned
    for pn, pm in ((2, 4), (4, 8)):
        mask = torch.zeros_like(score, dtype=torch.bool)
        for ii in range(cols):
            if ii % pm == 0:
                tmp = score[:, ii:ii + pm].float()
                mask.scatter_(1, ii + torch.topk(tmp, pn, dim=1, largest=False)[1], True)
        gv.add("wanda.nm_%d_%d" % (pm - pn, pm), mask_u8(~mask))
    # magnitude's ranking differs from Wanda's here (the case means something)
    mag = torch.zeros_like(score, dtype=torch.bool)
    mag.scatter_(1, torch.sort(torch.abs(w), dim=-1, stable=True)[1][:, :cols // 2], True)
    assert not torch.equal(mag, ~mask_u8(gv_last(gv, "wanda.mask_0.5")).bool().reshape(rows, cols))


def gv_last(gv, name):
    for n, t in gv.arrays:
        if n == name:
            return t
    raise KeyError(name)


def case_nm(gv, g):
    """ASP's 1-D N:M by magnitude: the N largest |w| of each M kept."""
    for n, m, rows, cols in ((2, 4, 16, 32), (1, 4, 8, 16), (3, 8, 8, 24), (5, 16, 4, 32)):
        w = distinct(g, rows, cols)
        groups = torch.abs(w).reshape(-1, m)
        keep = torch.zeros_like(groups, dtype=torch.bool)
        keep.scatter_(1, torch.topk(groups, n, dim=1, largest=True)[1], True)
        name = "nm_%d_%d" % (n, m)
        gv.add(name + ".w", w)
        gv.add(name + ".mask", mask_u8(keep))


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(31)
    gv = gen.Golden("sparse", 31, "torch.nn.utils.prune, Wanda's and ASP's selection")
    case_magnitude(gv, g)
    case_wanda(gv, g)
    case_nm(gv, g)
    gv.write()
    total = gen.update_section(MANIFEST_MARK, "", [])
    assert total < 100_000, total


if __name__ == "__main__":
    main()
