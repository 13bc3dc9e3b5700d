#!/usr/bin/env python3
"""
gen.py - golden vectors for memtrain's op table, made by PyTorch.

The files this writes are committed; the C tests (test/test_golden.c) read
them and need no Python. Rerun this only to change or add cases:

    python3 -m venv /tmp/venv-torch && /tmp/venv-torch/bin/pip install torch numpy
    /tmp/venv-torch/bin/python test/golden/gen.py          # from the repository root

Every random draw comes from a fixed seed, and torch runs on one thread, so a
rerun with the same torch on the same kind of CPU gives the same bytes (the
"native.*" arrays, and the last bits of fp32 results, may change with the
CPU's vector width: the header records it).

What "reference" means. Our kernels take inputs in a storage dtype (fp32,
fp16 or bf16), upcast them to fp32, compute in fp32 and round each output
to the storage dtype once (lib/ops/kernels.h). The reference arrays follow the
same model: inputs are drawn in fp32 and rounded to the dtype; torch then
computes in fp32 from those rounded values; outputs in the dtype are rounded
once. One refinement: the attention backward is given the forward's output
as stored (in the dtype), as our op is, so its reference is formed from
that (see case_attention). Arrays named "native.*" are, separately, what
torch returns when the same op runs directly in fp16 or bf16 on the CPU, and
"autograd.*" the attention backward by plain autograd; they are there to
document how torch itself differs from the model (MANIFEST.txt sums it up),
and no test requires our kernels to match them.

Every file's header names the torch version that made it, and so does
MANIFEST.txt, which lists the files with their sizes and hashes.

File format (.gv), all integers little-endian:

    magic     8 bytes  "MTGOLD01"
    u32       length of the header text, then the text (UTF-8): key=value
              pairs separated by spaces (torch version, case, seed, ...)
    u32       number of arrays
    per array:
      u32     length of the name, then the name (ASCII, no NUL)
      u32     dtype: 0 fp32, 1 fp16, 2 bf16 (both as raw 16-bit patterns),
              3 int32, 4 uint8
      u32     rank (0..4; rank 0 is a scalar of one element)
      u64     each dimension
      bytes   the elements, row-major, little-endian, no padding
    u32       CRC-32 (IEEE, as zlib.crc32) of every byte before it

Names are unique within a file. A reader must check every length against the
file size; the CRC catches damage the lengths do not.
"""

import hashlib
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

OUT = os.path.dirname(os.path.abspath(__file__))
MAGIC = b"MTGOLD01"
CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3, torch.uint8: 4}
DTYPES = [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16)]

torch.set_num_threads(1)
ENV = "torch=%s numpy=%s python=%d.%d.%d cpu_capability=%s" % (
    torch.__version__, np.__version__, *sys.version_info[:3],
    torch.backends.cpu.get_cpu_capability())

written = []    # (file name, bytes)
native_notes = []  # lines for MANIFEST.txt


def f32(x):
    """A Python float rounded to fp32: hyperparameters are passed to our
    kernels as float, so torch is given exactly the same numbers."""
    return float(np.float32(x))


class Golden:
    def __init__(self, case, seed, note=""):
        self.case, self.seed, self.note = case, seed, note
        self.arrays = []
        self.names = set()

    def add(self, name, t):
        if not torch.is_tensor(t):
            t = torch.tensor(t)
        t = t.detach().contiguous().cpu()
        assert name not in self.names, name
        assert t.dtype in CODE, (name, t.dtype)
        assert t.dim() <= 4, name
        self.names.add(name)
        self.arrays.append((name, t))

    def scalar_f32(self, name, v):
        self.add(name, torch.tensor(v, dtype=torch.float32))

    def scalar_i32(self, name, v):
        self.add(name, torch.tensor(v, dtype=torch.int32))

    def write(self):
        header = "%s case=%s seed=%d" % (ENV, self.case, self.seed)
        if self.note:
            header += " " + self.note
        hb = header.encode()
        out = bytearray(MAGIC)
        out += struct.pack("<I", len(hb)) + hb
        out += struct.pack("<I", len(self.arrays))
        for name, t in self.arrays:
            nb = name.encode("ascii")
            out += struct.pack("<I", len(nb)) + nb
            out += struct.pack("<II", CODE[t.dtype], t.dim())
            for d in t.shape:
                out += struct.pack("<Q", d)
            if t.dtype in (torch.float16, torch.bfloat16):
                raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
            else:
                raw = t.numpy().astype(t.numpy().dtype.newbyteorder("<")).tobytes()
            assert len(raw) == t.numel() * t.element_size()
            out += raw
        out += struct.pack("<I", zlib.crc32(bytes(out)) & 0xFFFFFFFF)
        fname = self.case + ".gv"
        with open(os.path.join(OUT, fname), "wb") as fh:
            fh.write(out)
        written.append((fname, len(out)))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=g, dtype=torch.float32) * scale + shift


def rnd(t, dt):
    """Rounds an fp32 tensor to dt (nearest even) and returns it in dt."""
    return t.to(dt)


def up(t):
    return t.to(torch.float32)


def mant_bits(dt):
    return {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dt]


def ulps_apart(dt, a, b):
    """|a - b| in units of dt's spacing at the larger magnitude; both fp32
    tensors holding dt values."""
    a, b = up(a), up(b)
    fi = torch.finfo(dt)
    m = torch.maximum(a.abs(), b.abs()).clamp(min=fi.tiny)
    sp = torch.pow(2.0, torch.floor(torch.log2(m)) - mant_bits(dt))
    d = (a - b).abs() / sp
    d[torch.isnan(a) & torch.isnan(b)] = 0
    return d


def note_native(case, dt, name, ref, native):
    """One MANIFEST line: how far torch's native result is from the
    round-inputs / compute-fp32 / round-once reference. Where torch returns
    dt and the reference is fp32 (parameter gradients, losses, saved
    statistics), the reference is rounded to dt first, so the line counts
    only what torch's native path adds beyond the final rounding."""
    ref, native = ref.detach(), native.detach()
    if native.dtype == torch.float32:
        r, n = up(ref), native
        d = (r - n).abs()
        scale = r.abs().max().clamp(min=1e-30)
        native_notes.append("%-14s %-9s fp32 vs fp32: max |diff| %.3g (%.3g of max |ref|), "
                            "%d/%d differ" % (case, name, d.max(), d.max() / scale,
                                              int((d != 0).sum()), d.numel()))
        return
    rounded = ref.dtype == torch.float32
    r = up(rnd(ref, dt)) if rounded else up(ref)
    n = up(native)
    u = ulps_apart(dt, r, n)
    scale = r.abs().max().clamp(min=1e-30)
    big = r.abs() >= 0.01 * scale
    native_notes.append("%-14s %-9s %s: %d/%d differ, max %.3g ulp (%.3g ulp where |ref| >= 1%% "
                        "of max), max |diff| %.3g of max |ref|"
                        % (case, name, "fp32 ref rounded to dt" if rounded else "dt vs dt",
                           int((u != 0).sum()), u.numel(), u.max(), u[big].max(),
                           (r - n).abs().max() / scale))


# ---------------------------------------------------------------- casts --

def case_casts():
    """fp32 -> fp16 and fp32 -> bf16 on edge values and random values;
    fp16 -> fp32 and bf16 -> fp32 on a sample of bit patterns, and a CRC-32
    of the results for all 65536 patterns (NaNs made canonical first: torch
    does not promise NaN payloads, and neither do we)."""
    g = gen(101)
    bits = []
    def b(u):
        bits.append(u & 0xFFFFFFFF)
    def v(x):
        b(struct.unpack("<I", struct.pack("<f", x))[0])
    for x in [0.0, 1.0, 2.0, 0.5, 3.0, 1e-3, 0.1, 1 / 3, math.pi, 1e4]:
        v(x); v(-x)
    v(-0.0)
    # fp16 range ends: 65504 is the largest finite; 65519.99.. rounds down,
    # 65520 (the tie with 2^16) rounds to inf
    for x in [65504.0, 65505.0, 65519.0, 65520.0, 65536.0, 1e5, 3.0e38]:
        v(x); v(-x)
    b(0x477FEFFF); b(0x477FF000); b(0x477FF001); b(0xC77FEFFF); b(0xC77FF000)
    # infinities and NaNs (quiet, signalling, negative, odd payloads)
    for u in [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000,
              0x7FFFFFFF, 0xFFFFFFFF, 0x7F802000, 0x7FC00001]:
        b(u)
    # fp16 subnormals: 2^-24 is the smallest; 2^-25 is the tie with 0 (-> 0),
    # just above it rounds up; ties between subnormals go to even
    for k in range(14, 27):
        v(2.0 ** -k); v(-(2.0 ** -k))
    for m in [1.5, 2.5, 3.5, 1023.5, 1022.5, 0.75, 0.25, 1.0000001]:
        v(m * 2.0 ** -24)
    b(0x33000000); b(0x33000001); b(0x32FFFFFF); b(0x387FE000); b(0x387FF000); b(0x387FFFFF)
    b(0x38800000 - 1); b(0x38000000)
    # normal-range ties: fp16 keeps 10 mantissa bits, bf16 7
    for base in [1.0, 1.5, 1024.0, 3.0e-5, 7.0]:
        for (nb, m) in [(11, 1), (11, 3), (8, 1), (8, 3)]:
            x = base * (1 + m * 2.0 ** -nb)
            v(x); v(-x)
            xb = struct.unpack("<I", struct.pack("<f", x))[0]
            b(xb + 1); b(xb - 1)
    # bf16 range end: 0x7F7F8000 is the tie between the largest bf16 and
    # 2^128 (odd mantissa: rounds up to inf); FLT_MAX -> inf
    for u in [0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F7E8000, 0xFF7F8000]:
        b(u)
    # fp32 subnormals: bf16 keeps them (ties to even), fp16 flushes them to 0
    for u in [0x00000001, 0x00008000, 0x00018000, 0x00010000, 0x0000FFFF, 0x007FFFFF,
              0x00800000, 0x807FFFFF, 0x00028000, 0x00038000]:
        b(u)
    edge = torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)

    # random: any bit pattern; magnitudes spread over the fp16 range with
    # random signs; and exact ties for each format (a representable value
    # plus half its spacing)
    n = 4096
    anybits = torch.randint(-(2 ** 31), 2 ** 31, (n,), generator=g, dtype=torch.int64)
    anyf = anybits.to(torch.int32).view(torch.float32)
    mag = torch.pow(2.0, torch.rand(n, generator=g) * 44 - 27)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    spread = (mag * sign).to(torch.float32)
    ties = []
    for dt in (torch.float16, torch.bfloat16):
        base = (torch.pow(2.0, torch.rand(n // 2, generator=g) * 36 - 20)
                * torch.where(torch.rand(n // 2, generator=g) < 0.5, -1.0, 1.0)).to(dt).float()
        fi_m = mant_bits(dt)
        a = base.abs().clamp(min=torch.finfo(dt).tiny)
        sp = torch.pow(2.0, torch.floor(torch.log2(a)) - fi_m)
        ties.append(base + torch.sign(base) * sp / 2)
    ties = torch.cat(ties)
    src = torch.cat([edge, anyf, spread, ties]).contiguous()

    # what torch does with NaN payloads, for the record (not compared)
    def nan_outputs(src_bits_nan, out_bits, width):
        pats = sorted(set(int(x) & ((1 << width) - 1) for x in out_bits[src_bits_nan]))
        return " ".join("0x%0*x" % (width // 4, p) for p in pats[:6]) + (" ..." if len(pats) > 6 else "")
    isn = torch.isnan(src).numpy()
    native_notes.append("casts          NaN fp32->fp16: %d NaN inputs give %s" % (
        isn.sum(), nan_outputs(isn, src.to(torch.float16).view(torch.int16).numpy(), 16)))
    native_notes.append("casts          NaN fp32->bf16: %d NaN inputs give %s" % (
        isn.sum(), nan_outputs(isn, src.to(torch.bfloat16).view(torch.int16).numpy(), 16)))
    gv = Golden("casts", 101, "note=nan_payloads_not_compared")
    gv.add("f32_in", src)
    gv.add("f16_out", src.to(torch.float16))
    gv.add("bf16_out", src.to(torch.bfloat16))

    # 16-bit -> fp32 on a sample: every 16th pattern, plus every pattern
    # whose exponent field is 0 or all ones (subnormals, inf, NaN) in fp16
    pats = set(range(0, 65536, 16))
    for p in range(65536):
        e16 = (p >> 10) & 0x1F
        if (e16 == 0 or e16 == 0x1F) and (p & 0x3FF) % 8 in (0, 1, 7):
            pats.add(p)
        e8 = (p >> 7) & 0xFF
        if (e8 == 0 or e8 == 0xFF) and (p & 0x7F) % 8 in (0, 1, 7):
            pats.add(p)
    pats = torch.tensor(sorted(pats), dtype=torch.int32)
    pats16 = pats.to(torch.int16)
    gv.add("h_in", pats16.view(torch.float16))
    gv.add("h_to_f32", pats16.view(torch.float16).float())
    gv.add("b_in", pats16.view(torch.bfloat16))
    gv.add("b_to_f32", pats16.view(torch.bfloat16).float())

    allp = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    for tag, dt in (("h", torch.float16), ("b", torch.bfloat16)):
        out = allp.view(dt).float()
        isn = torch.isnan(out).numpy()
        native_notes.append("casts          NaN %s->fp32: %d NaN patterns give %s" % (
            "fp16" if tag == "h" else "bf16", isn.sum(),
            nan_outputs(isn, out.view(torch.int32).numpy(), 32)))
        u = out.view(torch.int32).numpy().astype("<i4")
        u[np.isnan(out.numpy())] = 0x7FC00000
        crc = zlib.crc32(u.tobytes()) & 0xFFFFFFFF
        # stored as the int32 with the same bits
        gv.scalar_i32("%s_all_crc" % tag, crc - (1 << 32) if crc >= (1 << 31) else crc)
    gv.write()


# ------------------------------------------------------------ layernorm --

def case_layernorm():
    N, C, eps = 7, 45, 1e-5
    for tag, dt in DTYPES:
        g = gen(200)
        # rows of different scales and offsets; row 3 constant (variance 0:
        # rstd is 1/sqrt(eps) and only a two-pass or Welford variance gets it)
        scale = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.5, 0.25, 3.0]).view(N, 1)
        shift = torch.tensor([0.0, 3.0, -2.0, 0.3, 1.0, -0.5, 0.0]).view(N, 1)
        x = rnd(randn(g, N, C) * scale + shift, dt)
        w = rnd(randn(g, C, scale=0.5, shift=1.0), dt)
        bb = rnd(randn(g, C, scale=0.2), dt)
        dout = rnd(randn(g, N, C), dt)

        x32 = up(x).requires_grad_(True)
        w32 = up(w).requires_grad_(True)
        b32 = up(bb).requires_grad_(True)
        out, mean, rstd = torch.ops.aten.native_layer_norm(x32, (C,), w32, b32, eps)
        out.backward(up(dout))
        gv = Golden("layernorm_" + tag, 200, "eps=1e-5")
        gv.scalar_i32("N", N); gv.scalar_i32("C", C)
        gv.add("x", x); gv.add("w", w); gv.add("b", bb); gv.add("dout", dout)
        gv.add("out", rnd(out, dt))
        gv.add("mean", mean.view(N)); gv.add("rstd", rstd.view(N))
        gv.add("dx", rnd(x32.grad, dt))
        gv.add("dw", w32.grad); gv.add("db", b32.grad)
        if dt != torch.float32:
            xn, wn, bn = (t.clone().requires_grad_(True) for t in (x, w, bb))
            on, mn, rn = torch.ops.aten.native_layer_norm(xn, (C,), wn, bn, eps)
            on.backward(dout)
            gv.add("native.out", on); gv.add("native.mean", mn.view(N)); gv.add("native.rstd", rn.view(N))
            gv.add("native.dx", xn.grad); gv.add("native.dw", wn.grad); gv.add("native.db", bn.grad)
            c = "layernorm_" + tag
            note_native(c, dt, "out", rnd(out, dt), on)
            note_native(c, dt, "mean", mean.view(N), mn.view(N))
            note_native(c, dt, "rstd", rstd.view(N), rn.view(N))
            note_native(c, dt, "dx", rnd(x32.grad, dt), xn.grad)
            note_native(c, dt, "dw", w32.grad, wn.grad)
            note_native(c, dt, "db", b32.grad, bn.grad)
        gv.write()


# ----------------------------------------------------------------- gelu --

def case_gelu():
    for tag, dt in DTYPES:
        g = gen(300)
        x = torch.cat([torch.linspace(-8, 8, 321), randn(g, 600, scale=2.0),
                       torch.tensor([0.0, -0.0, 1e-4, -1e-4, 1e-7, -1e-7, 10.0, -10.0, 20.0,
                                     -20.0, 60.0, -60.0, 200.0, -200.0, 3.0, -3.0])])
        x = rnd(x, dt)
        dy = rnd(randn(g, x.numel()), dt)
        x32 = up(x).requires_grad_(True)
        y = F.gelu(x32, approximate="tanh")
        y.backward(up(dy))
        gv = Golden("gelu_" + tag, 300, "approximate=tanh")
        gv.add("x", x); gv.add("dy", dy)
        gv.add("y", rnd(y, dt)); gv.add("dx", rnd(x32.grad, dt))
        if dt != torch.float32:
            xn = x.clone().requires_grad_(True)
            yn = F.gelu(xn, approximate="tanh")
            yn.backward(dy)
            gv.add("native.y", yn); gv.add("native.dx", xn.grad)
            note_native("gelu_" + tag, dt, "y", rnd(y, dt), yn)
            note_native("gelu_" + tag, dt, "dx", rnd(x32.grad, dt), xn.grad)
        gv.write()


# ------------------------------------------------------------ attention --

def split_heads(qkv, B, T, C, H):
    hs = C // H
    q, k, v = qkv.split(C, dim=-1)
    return [t.reshape(B, T, H, hs).transpose(1, 2) for t in (q, k, v)]


def merge_heads(t, B, T, C):
    return t.transpose(1, 2).reshape(B, T, C)


def case_attention():
    """Forward from the dtype-rounded qkv in fp32. The backward follows our
    op's contract: it is given the forward's output as stored (rounded to
    the dtype) and the fp32 logsumexp, recomputes the probabilities from
    them, and forms D = rowsum(dout * out) from the stored output; so "dqkv"
    is computed by those formulas in fp32. Autograd through the fp32 forward
    (which uses the unrounded output) is kept as "autograd.dqkv" for fp16
    and bf16: the two differ by what rounding the output costs D, and
    MANIFEST.txt says by how much."""
    # T above a typical key-block size, and not a multiple of one, so the
    # online softmax has to carry over blocks and handle a ragged last block
    B, T, C, H = 2, 67, 24, 3
    hs = C // H
    scale = 1.0 / math.sqrt(hs)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for tag, dt in DTYPES:
        g = gen(400)
        qkv = rnd(randn(g, B, T, 3 * C, scale=1.5), dt)
        dout = rnd(randn(g, B, T, C), dt)

        q32 = up(qkv).requires_grad_(True)
        q, k, v = split_heads(q32, B, T, C, H)
        s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        o = merge_heads(torch.softmax(s, dim=-1) @ v, B, T, C)
        o.backward(up(dout))
        autograd_dqkv = q32.grad
        out_dt = rnd(o.detach(), dt)
        lse = lse.detach()

        with torch.no_grad():
            q, k, v = split_heads(up(qkv), B, T, C, H)
            do = split_heads(torch.cat([up(dout)] * 3, dim=-1), B, T, C, H)[0]
            od = split_heads(torch.cat([up(out_dt)] * 3, dim=-1), B, T, C, H)[0]
            s = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
            p = torch.exp(s - lse.unsqueeze(-1))
            dv = p.transpose(-1, -2) @ do
            dp = do @ v.transpose(-1, -2)
            dd = (do * od).sum(-1, keepdim=True)
            ds = p * (dp - dd)
            dq = (ds @ k) * scale
            dk = (ds.transpose(-1, -2) @ q) * scale
            dqkv = torch.cat([merge_heads(t, B, T, C) for t in (dq, dk, dv)], dim=-1)
        if dt == torch.float32:
            # the formulas are autograd's, up to fp32 summation order
            err = (dqkv - autograd_dqkv).abs().max() / autograd_dqkv.abs().max()
            assert err < 1e-5, err

        gv = Golden("attention_" + tag, 400, "causal=1 scale=1/sqrt(hs)")
        for nm, val in (("B", B), ("T", T), ("C", C), ("H", H)):
            gv.scalar_i32(nm, val)
        gv.add("qkv", qkv); gv.add("dout", dout)
        gv.add("out", out_dt); gv.add("lse", lse)
        gv.add("dqkv", rnd(dqkv, dt))
        if dt != torch.float32:
            gv.add("autograd.dqkv", rnd(autograd_dqkv, dt))
            note_native("attention_" + tag, dt, "autograd", rnd(dqkv, dt), rnd(autograd_dqkv, dt))
            qn = qkv.clone().requires_grad_(True)
            a, bk, c = split_heads(qn, B, T, C, H)
            on = merge_heads(F.scaled_dot_product_attention(a, bk, c, is_causal=True), B, T, C)
            on.backward(dout)
            a2, b2, c2 = split_heads(qkv, B, T, C, H)
            lse_n = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                a2, b2, c2, 0.0, True)[1]
            gv.add("native.out", on); gv.add("native.dqkv", qn.grad)
            gv.add("native.lse", lse_n.float())
            c_ = "attention_" + tag
            note_native(c_, dt, "out", out_dt, on)
            note_native(c_, dt, "lse", lse, lse_n.float())
            note_native(c_, dt, "dqkv", rnd(dqkv, dt), qn.grad)
        gv.write()


# ----------------------------------------------------------------- xent --

def case_xent():
    N, V, Vp = 6, 50, 64
    for tag, dt in DTYPES:
        g = gen(500)
        logits = randn(g, N, Vp, scale=3.0)
        logits[2] += 20.0       # a large common offset: logsumexp must subtract the max
        logits[4, 7] = 25.0     # one dominant class
        # padding columns hold garbage that would show up if they were used
        logits[:, V:] = 40.0 + randn(g, N, Vp - V)
        logits = rnd(logits, dt)
        targets = torch.tensor([0, 49, 13, 7, 7, 25], dtype=torch.int32)
        dloss = f32(1.0 / N)
        l32 = up(logits)[:, :V].clone().requires_grad_(True)
        losses = F.cross_entropy(l32, targets.long(), reduction="none")
        losses.backward(torch.full((N,), dloss))
        dl = torch.zeros(N, Vp)
        dl[:, :V] = l32.grad
        gv = Golden("xent_" + tag, 500, "dloss=1/N")
        gv.scalar_i32("N", N); gv.scalar_i32("V", V); gv.scalar_i32("Vp", Vp)
        gv.scalar_f32("dloss", dloss)
        gv.add("logits", logits); gv.add("targets", targets)
        gv.add("losses", losses.detach()); gv.add("dlogits", rnd(dl, dt))
        if dt != torch.float32:
            ln = logits[:, :V].clone().requires_grad_(True)
            lossn = F.cross_entropy(ln, targets.long(), reduction="none")
            lossn.backward(torch.full((N,), dloss, dtype=dt))
            dln = torch.zeros(N, Vp, dtype=dt)
            dln[:, :V] = ln.grad
            gv.add("native.losses", lossn); gv.add("native.dlogits", dln)
            note_native("xent_" + tag, dt, "losses", losses.detach(), lossn)
            note_native("xent_" + tag, dt, "dlogits", rnd(dl, dt), dln)
        gv.write()


# --------------------------------------------------------------- matmul --

def case_matmul():
    N, I, O = 17, 48, 24
    for tag, dt in DTYPES:
        g = gen(600)
        x = rnd(randn(g, N, I), dt)
        w = rnd(randn(g, O, I, scale=1.0 / math.sqrt(I)), dt)
        bb = rnd(randn(g, O, scale=0.1), dt)
        dy = rnd(randn(g, N, O), dt)
        x32, w32, b32 = (up(t).requires_grad_(True) for t in (x, w, bb))
        y = F.linear(x32, w32, b32)
        y.backward(up(dy))
        gv = Golden("matmul_" + tag, 600, "y=x.W^T+b")
        gv.scalar_i32("N", N); gv.scalar_i32("I", I); gv.scalar_i32("O", O)
        gv.add("x", x); gv.add("w", w); gv.add("b", bb); gv.add("dy", dy)
        gv.add("y", rnd(y, dt))
        gv.add("y_nobias", rnd(F.linear(up(x), up(w)), dt))
        gv.add("dx", rnd(x32.grad, dt)); gv.add("dw", w32.grad); gv.add("db", b32.grad)
        if dt != torch.float32:
            xn, wn, bn = (t.clone().requires_grad_(True) for t in (x, w, bb))
            yn = F.linear(xn, wn, bn)
            yn.backward(dy)
            gv.add("native.y", yn); gv.add("native.dx", xn.grad)
            gv.add("native.dw", wn.grad); gv.add("native.db", bn.grad)
            c = "matmul_" + tag
            note_native(c, dt, "y", rnd(y, dt), yn)
            note_native(c, dt, "dx", rnd(x32.grad, dt), xn.grad)
            note_native(c, dt, "dw", w32.grad, wn.grad)
            note_native(c, dt, "db", b32.grad, bn.grad)
        gv.write()


# ----------------------------------------------------------- GradScaler --

def case_scaler(name, seed, steps, init_scale, growth, backoff, interval, inject, loss_mul=1.0):
    """A tiny model (Linear 6 -> 4, MSE) trained with fp32 master gradients,
    torch.amp.GradScaler and plain SGD. `inject` maps a step to the values
    written into chosen gradient elements after backward (an overflow that a
    half-precision forward would have produced). Per step we record the
    scaled gradients as the optimizer sees them, the unscaled ones,
    found_inf, whether the step was skipped, the scale and growth tracker
    after update(), and the parameters after the step."""
    g = gen(seed)
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 4)
    with torch.no_grad():
        model.weight.copy_(randn(g, 4, 6, scale=0.3))
        model.bias.copy_(randn(g, 4, scale=0.1))
    lr = f32(0.05)
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    kw = {}
    if init_scale is not None:
        kw = dict(init_scale=init_scale, growth_factor=growth, backoff_factor=backoff,
                  growth_interval=interval)
    scaler = torch.amp.GradScaler("cpu", **kw)
    sd = scaler.state_dict()
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])
    params = [flat(model.parameters()).detach().clone()]
    rec = {k: [] for k in ("scale_used", "grads_scaled", "grads_unscaled", "found_inf",
                           "skipped", "scale_after", "tracker_after")}
    for step in range(steps):
        x = randn(g, 8, 6)
        tgt = randn(g, 8, 4)
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x), tgt) * loss_mul
        rec["scale_used"].append(scaler.get_scale())
        scaler.scale(loss).backward()
        for (pi, idx, val) in inject.get(step, []):
            p = list(model.parameters())[pi]
            p.grad.view(-1)[idx] = val
        rec["grads_scaled"].append(flat(p.grad for p in model.parameters()).clone())
        scaler.unscale_(opt)
        gu = flat(p.grad for p in model.parameters()).clone()
        rec["grads_unscaled"].append(gu)
        found = bool((~torch.isfinite(gu)).any())
        # cross-check against the scaler's own record of this optimizer
        st = scaler._per_optimizer_states[id(opt)]
        own = sum(v.item() for v in st["found_inf_per_device"].values())
        assert bool(own) == found, (step, own, found)
        before = flat(model.parameters()).detach().clone()
        scaler.step(opt)
        scaler.update()
        after = flat(model.parameters()).detach().clone()
        if found:
            assert torch.equal(before, after)
        rec["found_inf"].append(int(found))
        rec["skipped"].append(int(found))
        sd = scaler.state_dict()
        rec["scale_after"].append(sd["scale"])
        rec["tracker_after"].append(sd["_growth_tracker"])
        params.append(after)
    gv = Golden(name, seed, "model=linear6x4_mse optimizer=sgd")
    gv.scalar_f32("init_scale", rec["scale_used"][0])
    gv.scalar_f32("growth_factor", sd["growth_factor"])
    gv.scalar_f32("backoff_factor", sd["backoff_factor"])
    gv.scalar_i32("growth_interval", sd["growth_interval"])
    gv.scalar_f32("lr", lr)
    gv.add("scale_used", torch.tensor(rec["scale_used"], dtype=torch.float32))
    gv.add("grads_scaled", torch.stack(rec["grads_scaled"]))
    gv.add("grads_unscaled", torch.stack(rec["grads_unscaled"]))
    gv.add("found_inf", torch.tensor(rec["found_inf"], dtype=torch.int32))
    gv.add("skipped", torch.tensor(rec["skipped"], dtype=torch.int32))
    gv.add("scale_after", torch.tensor(rec["scale_after"], dtype=torch.float32))
    gv.add("tracker_after", torch.tensor(rec["tracker_after"], dtype=torch.int32))
    gv.add("params", torch.stack(params))
    gv.write()


def case_scalers():
    inf, nan = float("inf"), float("nan")
    # growth every 5 clean steps; overflows at chosen steps, including one
    # right before the tracker would reach the interval, runs of them, NaN,
    # -inf, and several bad elements at once
    inj = {3: [(0, 5, inf)], 9: [(1, 2, nan)], 10: [(0, 0, -inf)], 11: [(0, 23, inf)],
           19: [(0, 1, inf), (1, 3, nan)], 24: [(1, 0, inf)], 31: [(0, 7, nan)],
           37: [(0, 11, inf)], 38: [(0, 11, inf)], 39: [(0, 11, inf)], 40: [(1, 1, -inf)],
           52: [(0, 2, nan)], 58: [(0, 3, inf)]}
    case_scaler("scaler_interval5", 700, 60, 65536.0, 2.0, 0.5, 5, inj)
    # torch's defaults (interval 2000: no growth in 60 steps); a run of 18
    # overflows takes the scale below 1
    inj = {2: [(0, 0, inf)], 30: [(1, 1, nan)], 45: [(0, 4, -inf)]}
    for s in range(5, 23):
        inj[s] = [(0, s % 24, inf)]
    case_scaler("scaler_default", 701, 60, None, None, None, None, inj)
    # growth stops at the largest power of two fp32 holds: torch keeps the
    # scale when growing would make it inf, and still resets the tracker.
    # The loss is made tiny so that scaled gradients stay finite.
    inj = {6: [(0, 0, inf)]}
    case_scaler("scaler_saturate", 702, 12, 2.0 ** 124, 2.0, 0.5, 1, inj, loss_mul=2.0 ** -100)


# ----------------------------------------------------------- optimizers --

def optim_grads(g, steps, n):
    gs = randn(g, steps, n)
    gs[:, 0] *= 1e-4   # tiny gradients: eps matters
    gs[:, 1] *= 100.0  # large ones
    gs[2, 2] = 0.0     # an exact zero
    return gs


def case_adamw():
    n, steps = 37, 6
    cfgs = [
        dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2),   # torch defaults
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
        dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
    ]
    gv = Golden("adamw", 800, "impl=single_tensor(foreach=False)")
    gv.scalar_i32("configs", len(cfgs))
    for ci, c in enumerate(cfgs):
        g = gen(800 + ci)
        c = dict(lr=f32(c["lr"]), betas=(f32(c["betas"][0]), f32(c["betas"][1])),
                 eps=f32(c["eps"]), weight_decay=f32(c["weight_decay"]))
        p = torch.nn.Parameter(randn(g, n))
        grads = optim_grads(g, steps, n)
        opt = torch.optim.AdamW([p], foreach=False, **c)
        ps, ms, vs = [p.detach().clone()], [], []
        for s in range(steps):
            p.grad = grads[s].clone()
            opt.step()
            st = opt.state[p]
            ps.append(p.detach().clone()); ms.append(st["exp_avg"].clone())
            vs.append(st["exp_avg_sq"].clone())
        pre = "c%d." % ci
        gv.scalar_f32(pre + "lr", c["lr"]); gv.scalar_f32(pre + "beta1", c["betas"][0])
        gv.scalar_f32(pre + "beta2", c["betas"][1]); gv.scalar_f32(pre + "eps", c["eps"])
        gv.scalar_f32(pre + "weight_decay", c["weight_decay"])
        gv.add(pre + "grads", grads); gv.add(pre + "params", torch.stack(ps))
        gv.add(pre + "m", torch.stack(ms)); gv.add(pre + "v", torch.stack(vs))
    gv.write()


def case_sgd():
    n, steps = 37, 6
    cfgs = [
        dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0),
        dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0),
        dict(lr=0.05, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=1e-2),
        dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=1e-2),
        dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.05),
    ]
    gv = Golden("sgd", 900, "impl=single_tensor(foreach=False)")
    gv.scalar_i32("configs", len(cfgs))
    for ci, c in enumerate(cfgs):
        g = gen(900 + ci)
        c = {k: (f32(v) if isinstance(v, float) else v) for k, v in c.items()}
        p = torch.nn.Parameter(randn(g, n))
        grads = optim_grads(g, steps, n)
        opt = torch.optim.SGD([p], foreach=False, **c)
        ps, ms = [p.detach().clone()], []
        for s in range(steps):
            p.grad = grads[s].clone()
            opt.step()
            buf = opt.state[p].get("momentum_buffer") if p in opt.state else None
            ps.append(p.detach().clone())
            ms.append(buf.clone() if buf is not None else torch.zeros(n))
        pre = "c%d." % ci
        for k in ("lr", "momentum", "dampening", "weight_decay"):
            gv.scalar_f32(pre + k, c[k])
        gv.scalar_i32(pre + "nesterov", int(c["nesterov"]))
        gv.add(pre + "grads", grads); gv.add(pre + "params", torch.stack(ps))
        gv.add(pre + "m", torch.stack(ms))
    gv.write()


def update_section(mark, versions, extra):
    """Writes a generator's section of MANIFEST.txt, opened by the line
    `mark` (a "# ... written by ..." line): in place of an earlier one, else
    after gen.py's (first) section, ahead of the others. The section lists
    the files this process wrote (`written`) and then the lines `extra`.
    Returns the bytes of those files."""
    mpath = os.path.join(OUT, "MANIFEST.txt")
    text = open(mpath).read() if os.path.exists(mpath) else ""
    # where each generator's section starts: a "# ... written by ..." line
    starts, at = [], 0
    for line in text.splitlines(keepends=True):
        if line.startswith("# ") and "written by" in line:
            starts.append(at)
        at += len(line)
    mine = text.find(mark)
    if mine >= 0:
        later = [x for x in starts if x > mine]
        head, tail = text[:mine], text[later[0]:] if later else ""
    elif len(starts) > 1:
        head, tail = text[:starts[1]], text[starts[1]:]
    else:
        head, tail = text, ""
    head = head.rstrip("\n") + "\n\n" if head.strip() else ""
    lines = [mark, "# " + ENV + " " + versions, ""]
    total = 0
    for fname, nbytes in written:
        with open(os.path.join(OUT, fname), "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:16]
        lines.append("%-22s %8d bytes  sha256 %s" % (fname, nbytes, digest))
        total += nbytes
    lines.append("%-22s %8d bytes" % ("total", total))
    if extra:
        lines += [""] + list(extra)
    section = "\n".join(lines) + "\n"
    if tail:
        section += "\n" + tail
    with open(mpath, "w") as fh:
        fh.write(head + section)
    print(section)
    return total


def manifest_sections():
    """The sections of MANIFEST.txt, each opened by a line "# ..., written by
    SCRIPT": {script: text}. Other generators (gen_gpt2.py, gen_optim.py)
    keep their own sections; this script rewrites only its own."""
    sections, cur = {}, None
    path = os.path.join(OUT, "MANIFEST.txt")
    if not os.path.exists(path):
        return sections
    with open(path) as fh:
        for line in fh:
            if line.startswith("# ") and ", written by " in line:
                cur = line.rstrip("\n").rsplit(" ", 1)[-1]
                sections[cur] = ""
            if cur is not None:
                sections[cur] += line
    return sections


def main():
    others = manifest_sections()
    mine = others.pop("gen.py", "")
    # remove the files this script wrote last time (and only those)
    for line in mine.splitlines():
        f = line.split(" ", 1)[0]
        if f.endswith(".gv") and os.path.exists(os.path.join(OUT, f)):
            os.remove(os.path.join(OUT, f))
    case_casts()
    case_layernorm()
    case_gelu()
    case_attention()
    case_xent()
    case_matmul()
    case_scalers()
    case_adamw()
    case_sgd()
    total = sum(n for _, n in written)
    lines = ["# golden vectors, written by gen.py", "# " + ENV, ""]
    for fname, nbytes in written:
        with open(os.path.join(OUT, fname), "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()[:16]
        lines.append("%-22s %8d bytes  sha256 %s" % (fname, nbytes, digest))
    lines.append("%-22s %8d bytes" % ("total", total))
    lines += ["", "# torch run natively in fp16/bf16 on the CPU against the reference",
              "# (inputs rounded to the dtype, fp32 compute, outputs rounded once);",
              "# ulp = spacing of the dtype at the larger of the two values.",
              "# 'autograd' lines: the attention backward by autograd through the fp32",
              "# forward (unrounded output) against the one our op's contract defines",
              "# (from the output as stored in the dtype).", ""]
    lines += native_notes
    with open(os.path.join(OUT, "MANIFEST.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
        for text in others.values():
            fh.write("\n" + text.rstrip("\n") + "\n")
    print("\n".join(lines))
    assert total < 1_500_000, total


if __name__ == "__main__":
    main()
