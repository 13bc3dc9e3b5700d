#!/usr/bin/env python3
"""
gen_gpt2.py - a PyTorch reference of a whole GPT-2 model in llm.c's layout,
and golden files for memtrain's end-to-end tests.

Run from the repository root with a Python that has torch and numpy:

    /tmp/venv-torch/bin/python test/golden/gen_gpt2.py

With no arguments it writes the tiny configuration (V 61, Vp 128, maxT 16,
L 2, H 4, C 32; batch B 2, T 8, and B 1, T 16) into test/golden/:

    gpt2_tiny.bin         model checkpoint in llm.c's format (fp32, version 3)
    gpt2_tiny_tokens.bin  token file in llm.c's format (uint16 tokens)
    gpt2_tiny.gv          golden arrays for B 2, T 8 (format: see gen.py)
    gpt2_tiny_t16.gv      golden arrays for B 1, T maxT (16)

and appends its own section to MANIFEST.txt (replacing an earlier one).
Every shape is a flag (--V --Vp --maxT --L --H --C --B --T --seed), and
--out-prefix PATH writes PATH.bin, PATH_tokens.bin, PATH.gv and
PATH_t<maxT>.gv instead; MANIFEST.txt is touched only when the files go
into test/golden/.

The model (written out below, one formula per step):
    x = wte[tokens] + wpe[positions]                    wte (Vp, C), wpe (maxT, C)
    per layer l:
        h = LN(x; ln1w[l], ln1b[l])
        qkv = h qkvw[l]^T + qkvb[l]                     3C outputs: all queries,
                                                        then keys, then values;
                                                        head i at columns i*hs
        y = causal softmax(q k^T / sqrt(hs)) v          per head
        x = x + y attprojw[l]^T + attprojb[l]
        h = LN(x; ln2w[l], ln2b[l])
        x = x + GELU_tanh(h fcw[l]^T + fcb[l]) fcprojw[l]^T + fcprojb[l]
    x = LN(x; lnfw, lnfb)
    logits = x wte[:V]^T                                tied head, V real columns
    loss = mean over the B*T positions of -log softmax(logits)[target]
LayerNorm uses the biased variance and eps 1e-5. Weights are (out, in).
Rows V..Vp-1 of wte are zero, take part in nothing, and their gradient is
exactly zero. (llm.c multiplies by all Vp rows and leaves the padded
logits out of the softmax; the loss and every gradient are the same.)

Initialisation (GPT-2): from torch.Generator seeded with --seed, in this
order: wte[:V], wpe, qkvw, attprojw, fcw, fcprojw (each stacked over the
layers, drawn as one tensor), all N(0, 0.02) except attprojw and fcprojw,
N(0, 0.02/sqrt(2L)); LayerNorm weights 1, every bias 0. The parameters are
fp32. The tokens are drawn uniformly in [0, V) from a generator seeded with
seed + 1: 5*B*T + 1 of them (for the largest B*T written), enough for five
batches; batch i is inputs tokens[i*B*T : (i+1)*B*T] viewed as (B, T) and
targets the same slice shifted by one token.

What is in each .gv (names as in llm.c; shapes stacked over layers):
    V Vp maxT L H C B T seed        int32 scalars
    inputs, targets                 (B, T) int32: batch 0
    loss                            fp32 scalar: batch 0, the float64 reference
    logits                          (B*T, V) fp32: the float64 reference, rounded
    grad.<name>                     fp32, the shape of <name>: d loss / d <name>
                                    from the float64 reference, rounded once
    gradnorm.<name>                 fp32 scalar: L2 norm of grad.<name> (float64)
    adamw.lr, adamw.beta1, adamw.beta2, adamw.eps, adamw.weight_decay
                                    fp32 scalars, the values torch was given
    adamw.losses                    (5,) fp32: torch.optim.AdamW trained in fp32
                                    on the CPU (for-loop implementation), one
                                    batch per step in order; entry i is the loss
                                    of batch i before the i-th update
The reference loss and gradients are computed in float64 from the fp32
parameters (exactly representable there), so they carry no fp32 rounding
of their own. The B 1, T maxT file leaves out grad.fcw and grad.fcprojw to
keep the committed files small (their gradnorm.* are there; --full-extra
keeps them).

Checks made before anything is written (the script stops on a failure):
    - gradients of every tensor at several elements (the padded wte rows
      among them) against central finite differences of the float64 loss;
    - the written-out formulas against torch's own layer_norm, gelu,
      scaled_dot_product_attention and cross_entropy (loss and gradients);
    - padded rows of grad.wte exactly zero;
    - the checkpoint and token file read back by a separate reader.

Every draw comes from a fixed seed and torch runs on one thread, so a rerun
with the same torch on the same kind of CPU gives the same bytes (the last
bits of adamw.losses may change with the CPU's vector width: the header
records it).
"""

import argparse
import hashlib
import math
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
GV_MAGIC = b"MTGOLD01"
GV_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 3, torch.uint8: 4}
MODEL_MAGIC, MODEL_VERSION_FP32 = 20240326, 3
TOKENS_MAGIC, TOKENS_VERSION = 20240520, 1
HEADER_INTS = 256
LN_EPS = 1e-5
ADAMW_STEPS = 5
MANIFEST_MARK = "# gpt2 reference model, written by gen_gpt2.py"

torch.set_num_threads(1)
ENV = "torch=%s numpy=%s python=%d.%d.%d cpu_capability=%s" % (
    torch.__version__, np.__version__, *sys.version_info[:3],
    torch.backends.cpu.get_cpu_capability())


def f32(x):
    """A Python float rounded to fp32, so that torch and the C library are
    given the same hyperparameters."""
    return float(np.float32(x))


# ------------------------------------------------------------- layout --

def param_shapes(cfg):
    """The llm.c tensors, in checkpoint order, with their shapes."""
    V, Vp, maxT, L, C = cfg.V, cfg.Vp, cfg.maxT, cfg.L, cfg.C
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


def init_params(cfg):
    """GPT-2 initialisation, fp32, from cfg.seed (order in the docstring)."""
    g = torch.Generator().manual_seed(cfg.seed)
    shapes = dict(param_shapes(cfg))
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * cfg.L)

    def normal(shape, s):
        return torch.randn(*shape, generator=g, dtype=torch.float32) * f32(s)

    P = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in shapes.items()}
    P["wte"][:cfg.V] = normal((cfg.V, cfg.C), std)
    P["wpe"][:] = normal(shapes["wpe"], std)
    P["qkvw"][:] = normal(shapes["qkvw"], std)
    P["attprojw"][:] = normal(shapes["attprojw"], proj_std)
    P["fcw"][:] = normal(shapes["fcw"], std)
    P["fcprojw"][:] = normal(shapes["fcprojw"], proj_std)
    for name in ("ln1w", "ln2w", "lnfw"):
        P[name].fill_(1.0)
    return P


# -------------------------------------------------------------- model --

def layernorm(x, w, b):
    mean = x.mean(-1, keepdim=True)
    xc = x - mean
    var = (xc * xc).mean(-1, keepdim=True)
    return xc / torch.sqrt(var + LN_EPS) * w + b


def gelu_tanh(x):
    k = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + torch.tanh(k * (x + 0.044715 * x * x * x)))


def linear(x, w, b):
    return x @ w.transpose(0, 1) + b


def causal_attention(qkv, H):
    """qkv (B, T, 3C) -> (B, T, C); head h reads columns h*hs.. of each part."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    hs = C // H
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, T, H, hs).transpose(1, 2)
               for i in range(3))
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(hs))
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    s = s.masked_fill(future, float("-inf"))
    s = s - s.amax(-1, keepdim=True)
    p = torch.exp(s)
    p = p / p.sum(-1, keepdim=True)
    return (p @ v).transpose(1, 2).reshape(B, T, C)


def cross_entropy_mean(logits, targets):
    m = logits.amax(-1, keepdim=True)
    lse = (m + torch.log(torch.exp(logits - m).sum(-1, keepdim=True))).squeeze(-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (lse - picked).mean()


def forward(P, inputs, targets, cfg, builtin=False):
    """Mean loss and logits (B*T, V). builtin=True swaps the written-out
    formulas for torch's own functions (the cross-check)."""
    B, T = inputs.shape
    C, H, V = cfg.C, cfg.H, cfg.V
    if builtin:
        ln = lambda x, w, b: F.layer_norm(x, (C,), w, b, LN_EPS)
        act = lambda x: F.gelu(x, approximate="tanh")
        lin = F.linear

        def attn(qkv, H):
            hs = C // H
            q, k, v = (t.reshape(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, -1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = F.embedding(inputs, P["wte"]) + F.embedding(torch.arange(T), P["wpe"])
    else:
        ln, act, lin, attn = layernorm, gelu_tanh, linear, causal_attention
        x = P["wte"][inputs] + P["wpe"][:T]
    for l in range(cfg.L):
        h = ln(x, P["ln1w"][l], P["ln1b"][l])
        y = attn(lin(h, P["qkvw"][l], P["qkvb"][l]), H)
        x = x + lin(y, P["attprojw"][l], P["attprojb"][l])
        h = ln(x, P["ln2w"][l], P["ln2b"][l])
        h = act(lin(h, P["fcw"][l], P["fcb"][l]))
        x = x + lin(h, P["fcprojw"][l], P["fcprojb"][l])
    x = ln(x, P["lnfw"], P["lnfb"])
    logits = (x @ P["wte"][:V].transpose(0, 1)).reshape(B * T, V)
    t = targets.reshape(B * T)
    loss = F.cross_entropy(logits, t) if builtin else cross_entropy_mean(logits, t)
    return loss, logits


def as_leaves(P, dtype):
    return {k: v.detach().to(dtype).clone().requires_grad_(True) for k, v in P.items()}


def loss_and_grads(P32, inputs, targets, cfg, builtin=False):
    """float64 loss, logits and gradients from the fp32 parameters."""
    P = as_leaves(P32, torch.float64)
    loss, logits = forward(P, inputs, targets, cfg, builtin)
    loss.backward()
    return loss.item(), logits.detach(), {k: v.grad.detach() for k, v in P.items()}


# -------------------------------------------------------------- checks --

def finite_difference_check(P32, inputs, targets, cfg, grads, seed, per_tensor=6, h=1e-6):
    """Central differences of the float64 loss at chosen elements of every
    tensor. Returns (checked, max abs error, max relative error where
    |grad| > 1e-6)."""
    P = {k: v.detach().to(torch.float64).clone() for k, v in P32.items()}
    g = torch.Generator().manual_seed(seed + 7)
    picks = []
    for name, _ in param_shapes(cfg):
        n = P[name].numel()
        idx = torch.randint(0, n, (per_tensor,), generator=g).tolist()
        if name == "wte":
            C = cfg.C
            used = int(inputs.reshape(-1)[0])
            unused = next(t for t in range(cfg.V) if t not in set(inputs.reshape(-1).tolist()))
            idx += [used * C + 3, unused * C + 5, (cfg.V - 1) * C,  # real rows
                    cfg.V * C + 1, (cfg.Vp - 1) * C + C - 1]         # padded rows
        if name == "wpe":
            T = inputs.shape[1]
            idx += [(T - 1) * cfg.C + 2]
        if name == "qkvw":
            C = cfg.C
            l = cfg.L - 1
            base = l * 3 * C * C
            idx += [base + (0 * C + 1) * C + 4, base + (1 * C + C - 1) * C,
                    base + (2 * C + C // 2) * C + 7]                # a query, key, value row
        picks += [(name, i) for i in idx]
    worst_abs, worst_rel = 0.0, 0.0
    with torch.no_grad():
        for name, i in picks:
            flat = P[name].view(-1)
            x0 = flat[i].item()
            flat[i] = x0 + h
            lp = forward(P, inputs, targets, cfg)[0].item()
            flat[i] = x0 - h
            lm = forward(P, inputs, targets, cfg)[0].item()
            flat[i] = x0
            fd = (lp - lm) / (2 * h)
            ag = grads[name].reshape(-1)[i].item()
            err = abs(fd - ag)
            assert err <= 1e-7 + 1e-5 * abs(ag), (name, i, fd, ag)
            worst_abs = max(worst_abs, err)
            if abs(ag) > 1e-6:
                worst_rel = max(worst_rel, err / abs(ag))
    return len(picks), worst_abs, worst_rel


def builtin_check(P32, inputs, targets, cfg, loss, grads):
    """The written-out model against one made of torch's functions."""
    loss_b, _, grads_b = loss_and_grads(P32, inputs, targets, cfg, builtin=True)
    assert abs(loss_b - loss) <= 1e-12 * abs(loss), (loss, loss_b)
    worst = 0.0
    for k in grads:
        scale = max(grads[k].abs().max().item(), 1e-30)
        d = (grads[k] - grads_b[k]).abs().max().item() / scale
        assert d <= 1e-10, (k, d)
        worst = max(worst, d)
    return abs(loss_b - loss), worst


# --------------------------------------------------------------- files --

def write_checkpoint(path, cfg, P):
    hdr = np.zeros(HEADER_INTS, dtype="<i4")
    hdr[:8] = [MODEL_MAGIC, MODEL_VERSION_FP32, cfg.maxT, cfg.V, cfg.L, cfg.H, cfg.C, cfg.Vp]
    with open(path, "wb") as fh:
        fh.write(hdr.tobytes())
        for name, shape in param_shapes(cfg):
            t = P[name]
            assert tuple(t.shape) == shape and t.dtype == torch.float32, name
            fh.write(t.contiguous().numpy().astype("<f4").tobytes())


def read_checkpoint(path):
    """Independent of write_checkpoint: checks the header and the size."""
    raw = open(path, "rb").read()
    hdr = np.frombuffer(raw[:4 * HEADER_INTS], dtype="<i4")
    assert hdr[0] == MODEL_MAGIC and hdr[1] == MODEL_VERSION_FP32, hdr[:2]
    maxT, V, L, H, C, Vp = (int(v) for v in hdr[2:8])
    assert not hdr[8:].any()
    cfg = argparse.Namespace(maxT=maxT, V=V, L=L, H=H, C=C, Vp=Vp)
    shapes = param_shapes(cfg)
    n = sum(int(np.prod(s)) for _, s in shapes)
    assert len(raw) == 4 * HEADER_INTS + 4 * n, (len(raw), n)
    data = np.frombuffer(raw[4 * HEADER_INTS:], dtype="<f4")
    out, off = {}, 0
    for name, s in shapes:
        k = int(np.prod(s))
        out[name] = torch.from_numpy(data[off:off + k].reshape(s).copy())
        off += k
    return cfg, out


def write_tokens(path, tokens):
    hdr = np.zeros(HEADER_INTS, dtype="<i4")
    hdr[:3] = [TOKENS_MAGIC, TOKENS_VERSION, len(tokens)]
    with open(path, "wb") as fh:
        fh.write(hdr.tobytes())
        fh.write(np.asarray(tokens, dtype="<u2").tobytes())


def read_tokens(path):
    raw = open(path, "rb").read()
    hdr = np.frombuffer(raw[:4 * HEADER_INTS], dtype="<i4")
    assert hdr[0] == TOKENS_MAGIC and hdr[1] == TOKENS_VERSION, hdr[:2]
    n = int(hdr[2])
    assert len(raw) == 4 * HEADER_INTS + 2 * n, (len(raw), n)
    return np.frombuffer(raw[4 * HEADER_INTS:], dtype="<u2").astype(np.int64)


def batch(tokens, i, B, T):
    s = i * B * T
    chunk = torch.as_tensor(tokens[s:s + B * T + 1], dtype=torch.long)
    assert chunk.numel() == B * T + 1, "token file too short"
    return chunk[:-1].reshape(B, T), chunk[1:].reshape(B, T)


class GoldenFile:
    """Writes the .gv format described in gen.py."""

    def __init__(self, header):
        self.header = header
        self.arrays = []

    def add(self, name, t):
        if not torch.is_tensor(t):
            t = torch.tensor(t)
        t = t.detach().contiguous().cpu()
        assert t.dtype in GV_CODE and t.dim() <= 4 and len(name) <= 64, (name, t.dtype)
        assert name not in (n for n, _ in self.arrays), name
        self.arrays.append((name, t))

    def i32(self, name, v):
        self.add(name, torch.tensor(v, dtype=torch.int32))

    def f32(self, name, v):
        self.add(name, torch.tensor(v, dtype=torch.float32))

    def write(self, path):
        hb = self.header.encode()
        assert len(hb) < 4096
        out = bytearray(GV_MAGIC)
        out += struct.pack("<I", len(hb)) + hb
        out += struct.pack("<I", len(self.arrays))
        for name, t in self.arrays:
            nb = name.encode("ascii")
            out += struct.pack("<I", len(nb)) + nb
            out += struct.pack("<II", GV_CODE[t.dtype], t.dim())
            for d in t.shape:
                out += struct.pack("<Q", d)
            a = t.numpy()
            out += a.astype(a.dtype.newbyteorder("<")).tobytes()
        out += struct.pack("<I", zlib.crc32(bytes(out)) & 0xFFFFFFFF)
        with open(path, "wb") as fh:
            fh.write(out)


# ------------------------------------------------------------ training --

def adamw_losses(P32, tokens, cfg, B, T, hp):
    """fp32 training with torch.optim.AdamW, one batch per step in order."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in P32.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=hp["lr"],
                            betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                            weight_decay=hp["weight_decay"], foreach=False)
    losses = []
    for step in range(ADAMW_STEPS):
        inputs, targets = batch(tokens, step, B, T)
        opt.zero_grad(set_to_none=True)
        loss, _ = forward(params, inputs, targets, cfg)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    pad = params["wte"].detach()[cfg.V:]
    assert not pad.any(), "padded wte rows moved during training"
    return losses


# ---------------------------------------------------------------- main --

def make_case(cfg, P32, tokens, B, T, case, files, omit=()):
    """Writes files["prefix"] + suffix, where case = basename + suffix."""
    inputs, targets = batch(tokens, 0, B, T)
    loss, logits, grads = loss_and_grads(P32, inputs, targets, cfg)

    pad = grads["wte"][cfg.V:]
    assert pad.numel() == 0 or (pad == 0).all().item(), "padded grad.wte rows not zero"
    nfd, fd_abs, fd_rel = finite_difference_check(P32, inputs, targets, cfg, grads, cfg.seed)
    bl_loss, bl_grad = builtin_check(P32, inputs, targets, cfg, loss, grads)

    hp = dict(lr=f32(1e-3), beta1=f32(0.9), beta2=f32(0.999), eps=f32(1e-8), weight_decay=f32(0.0))
    losses = adamw_losses(P32, tokens, cfg, B, T, hp)
    # the fp32 forward of step 0 is the float64 reference up to fp32 rounding
    assert abs(losses[0] - loss) <= 1e-5 * abs(loss), (losses[0], loss)

    header = ("%s case=%s seed=%d V=%d Vp=%d maxT=%d L=%d H=%d C=%d B=%d T=%d "
              "checkpoint=%s tokens=%s batch=0 init=gpt2(std=0.02,proj_std=0.02/sqrt(2L)) "
              "reference=float64_from_fp32_params ln_eps=1e-5 gelu=tanh "
              "adamw=torch.optim.AdamW(foreach=False,fp32,cpu) adamw_steps=%d"
              % (ENV, case, cfg.seed, cfg.V, cfg.Vp, cfg.maxT, cfg.L, cfg.H, cfg.C, B, T,
                 os.path.basename(files["bin"]), os.path.basename(files["tokens"]), ADAMW_STEPS))
    if omit:
        header += " omitted=" + ",".join("grad." + n for n in omit)
    gv = GoldenFile(header)
    for k in ("V", "Vp", "maxT", "L", "H", "C"):
        gv.i32(k, getattr(cfg, k))
    gv.i32("B", B); gv.i32("T", T); gv.i32("seed", cfg.seed)
    gv.add("inputs", inputs.to(torch.int32))
    gv.add("targets", targets.to(torch.int32))
    gv.f32("loss", loss)
    gv.add("logits", logits.to(torch.float32))
    for name, _ in param_shapes(cfg):
        if name not in omit:
            gv.add("grad." + name, grads[name].to(torch.float32))
    for name, _ in param_shapes(cfg):
        gv.f32("gradnorm." + name, grads[name].norm().item())
    for k, v in hp.items():
        gv.f32("adamw." + k, v)
    gv.add("adamw.losses", torch.tensor(losses, dtype=torch.float32))
    path = os.path.join(os.path.dirname(files["prefix"]), case + ".gv")
    gv.write(path)

    print("%s: B=%d T=%d loss=%.9f (ln V = %.6f)" % (os.path.basename(path), B, T, loss, math.log(cfg.V)))
    print("  finite differences: %d elements, max |fd - grad| %.3g, max relative %.3g"
          % (nfd, fd_abs, fd_rel))
    print("  torch builtins: |loss diff| %.3g, max grad diff %.3g of max |grad|" % (bl_loss, bl_grad))
    print("  padded grad.wte rows: %d x %d, all exactly zero" % (cfg.Vp - cfg.V, cfg.C))
    print("  adamw.losses (fp32): " + " ".join("%.7f" % x for x in losses))
    return path


def update_manifest(paths):
    mpath = os.path.join(HERE, "MANIFEST.txt")
    text = open(mpath).read() if os.path.exists(mpath) else ""
    cut = text.find(MANIFEST_MARK)
    if cut >= 0:
        text = text[:cut]
    text = text.rstrip("\n") + "\n\n" if text.strip() else ""
    lines = [MANIFEST_MARK, "# " + ENV, ""]
    total = 0
    for p in paths:
        data = open(p, "rb").read()
        total += len(data)
        lines.append("%-22s %8d bytes  sha256 %s" % (os.path.basename(p), len(data),
                                                     hashlib.sha256(data).hexdigest()[:16]))
    lines.append("%-22s %8d bytes" % ("total", total))
    with open(mpath, "w") as fh:
        fh.write(text + "\n".join(lines) + "\n")
    return total


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="GPT-2 (llm.c layout) reference and golden files")
    ap.add_argument("--V", type=int, default=61)
    ap.add_argument("--Vp", type=int, default=128)
    ap.add_argument("--maxT", type=int, default=16)
    ap.add_argument("--L", type=int, default=2)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--C", type=int, default=32)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--T", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out-prefix", default=os.path.join(HERE, "gpt2_tiny"),
                    help="writes PREFIX.bin, PREFIX_tokens.bin, PREFIX.gv, PREFIX_t<maxT>.gv")
    ap.add_argument("--no-full-length", action="store_true",
                    help="skip the second file (B 1, T maxT)")
    ap.add_argument("--full-extra", action="store_true",
                    help="keep every gradient in the B 1, T maxT file")
    a = ap.parse_args(argv)
    if a.C % a.H or a.Vp < a.V or not 0 < a.T <= a.maxT or a.V > 65536:
        ap.error("need H | C, V <= Vp, 0 < T <= maxT, V <= 65536")
    return a


def main(argv=None):
    cfg = parse_args(argv)
    prefix = os.path.abspath(cfg.out_prefix)
    files = dict(prefix=prefix, case=os.path.basename(prefix),
                 bin=prefix + ".bin", tokens=prefix + "_tokens.bin")
    case = files["case"]
    cases = [(cfg.B, cfg.T, case, ())]
    if not cfg.no_full_length and (cfg.B, cfg.T) != (1, cfg.maxT):
        cases.append((1, cfg.maxT, "%s_t%d" % (case, cfg.maxT),
                      () if cfg.full_extra else ("fcw", "fcprojw")))

    P32 = init_params(cfg)
    ntok = ADAMW_STEPS * max(B * T for B, T, _, _ in cases) + 1
    g = torch.Generator().manual_seed(cfg.seed + 1)
    tokens = torch.randint(0, cfg.V, (ntok,), generator=g).numpy()

    write_checkpoint(files["bin"], cfg, P32)
    write_tokens(files["tokens"], tokens)
    rcfg, RP = read_checkpoint(files["bin"])
    assert all(getattr(rcfg, k) == getattr(cfg, k) for k in ("V", "Vp", "maxT", "L", "H", "C"))
    assert all(torch.equal(RP[k], P32[k]) for k in P32)
    rtok = read_tokens(files["tokens"])
    assert np.array_equal(rtok, tokens)
    assert os.path.getsize(files["tokens"]) == 1024 + 2 * ntok
    print("%s: %d parameters (%d in padded wte rows)" % (
        os.path.basename(files["bin"]), sum(v.numel() for v in P32.values()), (cfg.Vp - cfg.V) * cfg.C))
    print("%s: %d tokens" % (os.path.basename(files["tokens"]), ntok))

    written = [files["bin"], files["tokens"]]
    for B, T, name, omit in cases:
        written.append(make_case(cfg, P32, rtok, B, T, name, files, omit))

    if os.path.dirname(prefix) == HERE:
        total = update_manifest(written)
        print("MANIFEST.txt: %d bytes in %d files" % (total, len(written)))


if __name__ == "__main__":
    main()
