#!/usr/bin/env python3
"""
gen_quant.py - golden vectors for memtrain's blockwise weight quantizers
(lib/quant/quant.h): NF4 as bitsandbytes makes it, and int8 blockwise absmax.

Run from the repository root with a Python that has torch, numpy and
bitsandbytes (the .gv writer is gen.py's, imported):

    /tmp/venv-torch/bin/pip install torch numpy bitsandbytes
    /tmp/venv-torch/bin/python test/golden/gen_quant.py

It writes quant_nf4.gv and quant_int8.gv into test/golden/ and its own
section of MANIFEST.txt. The C side is test/test_quant.c.

quant_nf4.gv - the reference IS bitsandbytes, run here on the CPU:
functional.quantize_4bit(x, blocksize=64, compress_statistics=True,
quant_type="nf4") and functional.dequantize_4bit (fp32 and bf16 outputs).
Per case it stores the input x, the packed codes, the 8-bit codes of the
block absmaxes (absmax minus their mean), the fp32 absmax of each block of
256 of those, the offset (the mean), the absmaxes before double
quantization (for diagnosis), and the dequantized values. The file also
holds bitsandbytes' NF4 table and its 8-bit dynamic map (the C side checks
its own against them). Cases: random blocks at several scales, a block of
zeros, a block with one huge value, a block of signed zeros, values on the
NF4 midpoints (ties), subnormal values, a partial last block of odd length,
and one case of 257 blocks (two blocks of statistics, the second of one;
its bf16 output left out to keep the file small) chosen so that the
offset depends on the order of summation. The one-thread torch is used, as memtrain reproduces torch's
one-thread order of summation for the mean.

quant_int8.gv - memtrain's own int8 format has no outside reference; the
reference is this numpy model of its definition (lib/quant/quant.h): blocks of
64, scale = absmax / 127 in fp32 (0 for a block of zeros), code =
round-half-even(x / scale) clamped to [-127, 127], value = code * scale.

File format: see gen.py.
"""

import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen  # noqa: E402

import bitsandbytes as bnb  # noqa: E402
import bitsandbytes.functional as bnbf  # noqa: E402

MANIFEST_MARK = "# weight quantizers, written by gen_quant.py"
VERSIONS = "bitsandbytes=%s" % bnb.__version__
F = np.float32
BLOCK = 64


def nf4_case(gvf, name, x, bf16=True):
    """Quantizes x with bitsandbytes and stores what the C test checks."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=F))
    # the absmaxes before double quantization, for diagnosis
    _, raw = bnbf.quantize_4bit(t, blocksize=BLOCK, compress_statistics=False, quant_type="nf4")
    q, st = bnbf.quantize_4bit(t, blocksize=BLOCK, compress_statistics=True, quant_type="nf4")
    assert st.nested and st.state2.blocksize == 256 and st.blocksize == BLOCK
    deq = bnbf.dequantize_4bit(q, st).reshape(-1)
    deq_bf16 = bnbf.dequantize_4bit(q, st.__class__(
        absmax=st.absmax, shape=st.shape, dtype=torch.bfloat16, blocksize=st.blocksize,
        code=st.code, quant_type=st.quant_type, offset=st.offset, state2=st.state2)).reshape(-1)
    # bf16 output is the fp32 output rounded to nearest even
    assert torch.equal(deq_bf16, deq.to(torch.bfloat16)), name
    gvf.add(name + ".x", t)
    gvf.add(name + ".codes", q.reshape(-1))
    gvf.add(name + ".absmax_raw", raw.absmax.float())
    gvf.add(name + ".qabsmax", st.absmax.reshape(-1))
    gvf.add(name + ".absmax2", st.state2.absmax.float().reshape(-1))
    gvf.add(name + ".offset", st.offset.float().reshape(()))
    gvf.add(name + ".deq", deq.float())
    if bf16:
        gvf.add(name + ".deq_bf16", deq_bf16)


def sum_order_case(rng, NB=257):
    """257 blocks (two blocks of statistics, the second of one) whose
    absmaxes have a mean that depends on the order of summation: torch's
    (the offset) differs from both a correctly rounded mean and a plain
    running fp32 sum, so the case checks that order too."""
    for _ in range(1000):
        scales = np.exp(rng.uniform(-6, 3, NB)).astype(F)
        x = (rng.standard_normal((NB, BLOCK)).astype(F) * scales[:, None]).reshape(-1)
        am = np.abs(x.reshape(NB, BLOCK)).max(1).astype(F)
        tm = F(torch.from_numpy(am).mean().item())
        exact = F(am.astype(np.float64).sum() / NB)
        run = F(0)
        for v in am:
            run = F(run + v)
        if tm != exact and tm != F(run / F(NB)):
            return x
    raise AssertionError("no case found")


def case_nf4():
    rng = np.random.default_rng(17)
    code = bnbf.get_4bit_type("nf4", device="cpu").float()
    gvf = gen.Golden("quant_nf4", 17, "blocksize=64 compress_statistics=1 quant_type=nf4")
    gvf.add("nf4_code", code)
    gvf.add("dynamic_map", bnbf.create_dynamic_map(signed=True).float())

    blocks = []
    for s in (1.0, 1e-3, 40.0):
        blocks.append(rng.standard_normal(BLOCK).astype(F) * F(s))
    blocks.append(np.zeros(BLOCK, F))                              # all zeros
    b = (rng.standard_normal(BLOCK) * 1e-2).astype(F)
    b[17] = F(3.0e38)                                               # one huge value
    blocks.append(b)
    b = np.zeros(BLOCK, F)
    b[::2] = F(-0.0)                                                # signed zeros
    b[5] = F(-2.5)
    blocks.append(b)
    # ties: values on the midpoints between NF4 codes (absmax 1)
    c = code.numpy()
    mids = ((c[:-1] + c[1:]) / F(2)).astype(F)
    b = np.resize(np.concatenate([mids, -mids, np.nextafter(mids, F(2))]), BLOCK).astype(F)
    b[0] = F(1.0)
    blocks.append(b)
    blocks.append((rng.standard_normal(BLOCK) * 1e-40).astype(F))  # subnormals
    tail = (rng.standard_normal(37) * 0.5).astype(F)               # partial, odd
    mixed = np.concatenate(blocks + [tail])
    nf4_case(gvf, "mixed", mixed)

    nf4_case(gvf, "partial_only", (rng.standard_normal(10) * 3).astype(F))
    nf4_case(gvf, "big", sum_order_case(rng), bf16=False)
    gvf.write()


def int8_model(x):
    n = x.shape[0]
    nb = (n + BLOCK - 1) // BLOCK
    scale = np.zeros(nb, F)
    q = np.zeros(n, np.int8)
    deq = np.zeros(n, F)
    for b in range(nb):
        xb = x[b * BLOCK:(b + 1) * BLOCK]
        s = F(np.abs(xb).max() / F(127))
        scale[b] = s
        if s == 0:
            continue
        qb = np.clip(np.rint(xb / s), -127, 127).astype(np.int8)   # half to even
        q[b * BLOCK:(b + 1) * BLOCK] = qb
        deq[b * BLOCK:(b + 1) * BLOCK] = (qb.astype(F) * s).astype(F)
    return q, scale, deq


def case_int8():
    rng = np.random.default_rng(18)
    gvf = gen.Golden("quant_int8", 18, "blocksize=64 scale=absmax/127")
    parts = [rng.standard_normal(BLOCK).astype(F), np.zeros(BLOCK, F),
             (rng.standard_normal(BLOCK) * 1e-3).astype(F)]
    b = (rng.standard_normal(BLOCK) * 1e-2).astype(F)
    b[3] = F(-3.0e38)
    parts.append(b)
    b = (np.arange(BLOCK, dtype=F) - F(31.5)) / F(31.5) * F(127)     # halves: ties
    parts.append(b.astype(F))
    parts.append((rng.standard_normal(21) * 7).astype(F))
    x = np.concatenate(parts)
    q, scale, deq = int8_model(x)
    gvf.add("x", torch.from_numpy(x))
    gvf.add("codes", torch.from_numpy(q.view(np.uint8)))
    gvf.add("scale", torch.from_numpy(scale))
    gvf.add("deq", torch.from_numpy(deq))
    gvf.add("deq_bf16", torch.from_numpy(deq).to(torch.bfloat16))
    gvf.write()


def main():
    torch.set_num_threads(1)
    case_nf4()
    case_int8()
    total = gen.update_section(MANIFEST_MARK, VERSIONS, [])
    assert total < 170_000, total


if __name__ == "__main__":
    main()
