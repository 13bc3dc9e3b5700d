#!/usr/bin/env python3
"""
torch_gpt2.py - the PyTorch side of the GPT-2 training comparison: the same
model, data and optimizer as memtrain's GPT-2 trainer, timed on the CPU.

    python bench/torch_gpt2.py [--steps 10] [--warmup 2] [--threads N]
                               [--tokens FILE] [--llmc-checkpoint FILE]
                               [--checkpointing] [--bf16] [--foreach|--fused|--forloop]
                               [--adamw8] [--step-in-backward]

It prints one JSON line:

    {"impl": "pytorch", "torch": ..., "threads": ..., "B": ..., "T": ...,
     "params": ..., "ms_per_step_median": ..., "ms_per_step_min": ...,
     "peak_rss_mib": ..., "rss_before_model_mib": ..., "losses": [...], ...}

params counts every stored parameter, the padded rows of wte included (as
llm.c counts them). A step is zero_grad + forward + backward +
optimizer.step; the times are over the --steps timed steps, after --warmup
untimed ones. losses holds the loss of every step in order, warmup steps
first, each computed before that step's update. peak_rss_mib is
ru_maxrss at the end; rss_before_model_mib is ru_maxrss after torch is
imported and before the model is built, so their difference is what the
training run itself added.

Model: GPT-2 in llm.c's layout (see test/golden/gen_gpt2.py for the
formulas), default the 124M shape (V 50257, Vp 50304, maxT 1024, L 12,
H 12, C 768), fp32 parameters. The head multiplies by all Vp rows of the
tied wte, as llm.c does, and the loss takes the first V columns. Weights
are GPT-2's initialisation from --seed, drawn in the same order as
gen_gpt2.py (so the same seed gives the same weights), or are read from an
llm.c checkpoint (--llmc-checkpoint), whose header then sets the shape.
--write-llmc-checkpoint writes the starting weights in llm.c's format, so
that another implementation can start from the same point.

Data: batches in order from an llm.c token file (--tokens), B*T tokens
apart, inputs tokens[p : p+B*T] and targets shifted by one; back to the
start when the file runs out. Without --tokens, uniform random tokens in
[0, V) from --seed.

Optimizer: torch.optim.AdamW, lr --lr (3e-4), betas (0.9, 0.999), eps 1e-8,
weight decay --wd (0); --foreach, --fused or --forloop pick the
implementation (default: torch's own choice for CPU tensors).
--checkpointing recomputes each block in backward
(torch.utils.checkpoint, use_reentrant=False); --bf16 runs the forward
under torch.autocast("cpu", dtype=torch.bfloat16) with fp32 parameters.
--adamw8 uses bitsandbytes' AdamW8bit instead (blockwise 8-bit state,
tensors under 4096 elements 32-bit; bitsandbytes is imported only then, and
what it loads counts in peak_rss_mib). --step-in-backward runs each
parameter's optimizer step in a post-accumulate-grad hook and frees its
gradient there, so the gradients of the whole model never exist at once
(one optimizer per parameter; the same updates as the plain step).

--device cuda trains on the GPU instead (weights drawn on the CPU as above,
then moved; --bf16 autocasts on the GPU); the JSON then adds
peak_device_mib and peak_device_reserved_mib (torch.cuda's peak allocated
and reserved bytes), and the step times wait for the GPU.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

RSS_AFTER_IMPORT_KIB = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

MODEL_MAGIC, MODEL_VERSION_FP32 = 20240326, 3
TOKENS_MAGIC, TOKENS_VERSION = 20240520, 1
HEADER_INTS = 256
STACKED = ["ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
           "fcw", "fcb", "fcprojw", "fcprojb"]


def shapes(V, Vp, maxT, L, C):
    """llm.c's tensors in checkpoint order (per-layer ones stacked)."""
    per_layer = {"ln1w": (C,), "ln1b": (C,), "qkvw": (3 * C, C), "qkvb": (3 * C,),
                 "attprojw": (C, C), "attprojb": (C,), "ln2w": (C,), "ln2b": (C,),
                 "fcw": (4 * C, C), "fcb": (4 * C,), "fcprojw": (C, 4 * C), "fcprojb": (C,)}
    out = [("wte", (Vp, C)), ("wpe", (maxT, C))]
    out += [(k, (L,) + per_layer[k]) for k in STACKED]
    out += [("lnfw", (C,)), ("lnfb", (C,))]
    return out


class Block(torch.nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.C, self.H = C, H
        z = lambda *s: torch.nn.Parameter(torch.zeros(*s))
        self.ln1w, self.ln1b = z(C), z(C)
        self.qkvw, self.qkvb = z(3 * C, C), z(3 * C)
        self.attprojw, self.attprojb = z(C, C), z(C)
        self.ln2w, self.ln2b = z(C), z(C)
        self.fcw, self.fcb = z(4 * C, C), z(4 * C)
        self.fcprojw, self.fcprojb = z(C, 4 * C), z(C)

    def forward(self, x):
        B, T, C = x.shape
        H, hs = self.H, C // self.H
        h = F.layer_norm(x, (C,), self.ln1w, self.ln1b, 1e-5)
        qkv = F.linear(h, self.qkvw, self.qkvb)
        q, k, v = (t.view(B, T, H, hs).transpose(1, 2) for t in qkv.split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, C)
        x = x + F.linear(y, self.attprojw, self.attprojb)
        h = F.layer_norm(x, (C,), self.ln2w, self.ln2b, 1e-5)
        h = F.gelu(F.linear(h, self.fcw, self.fcb), approximate="tanh")
        return x + F.linear(h, self.fcprojw, self.fcprojb)


class GPT2(torch.nn.Module):
    def __init__(self, V, Vp, maxT, L, H, C, recompute=False):
        super().__init__()
        self.V, self.Vp, self.maxT, self.L, self.H, self.C = V, Vp, maxT, L, H, C
        self.recompute = recompute
        self.wte = torch.nn.Parameter(torch.zeros(Vp, C))
        self.wpe = torch.nn.Parameter(torch.zeros(maxT, C))
        self.blocks = torch.nn.ModuleList(Block(C, H) for _ in range(L))
        self.lnfw = torch.nn.Parameter(torch.ones(C))
        self.lnfb = torch.nn.Parameter(torch.zeros(C))

    def forward(self, idx, targets):
        B, T = idx.shape
        x = F.embedding(idx, self.wte) + self.wpe[:T]
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=False) if self.recompute else blk(x)
        x = F.layer_norm(x, (self.C,), self.lnfw, self.lnfb, 1e-5)
        logits = F.linear(x, self.wte)                   # (B, T, Vp)
        logits = logits[..., :self.V].reshape(B * T, self.V)
        return F.cross_entropy(logits.float(), targets.reshape(B * T))

    # llm.c layout: dict of stacked tensors <-> the parameters
    def llmc_tensors(self):
        out = {"wte": self.wte, "wpe": self.wpe, "lnfw": self.lnfw, "lnfb": self.lnfb}
        for k in STACKED:
            out[k] = torch.stack([getattr(b, k) for b in self.blocks])
        return {k: v.detach() for k, v in out.items()}

    @torch.no_grad()
    def load_llmc_tensors(self, T):
        self.wte.copy_(T["wte"]); self.wpe.copy_(T["wpe"])
        self.lnfw.copy_(T["lnfw"]); self.lnfb.copy_(T["lnfb"])
        for k in STACKED:
            for l, b in enumerate(self.blocks):
                getattr(b, k).copy_(T[k][l])

    @torch.no_grad()
    def init_gpt2(self, seed):
        """N(0, 0.02); output projections N(0, 0.02/sqrt(2L)); LayerNorm
        weights 1, biases 0; padded wte rows 0. Drawn in the order wte[:V],
        wpe, qkvw, attprojw, fcw, fcprojw, each stacked over the layers."""
        g = torch.Generator().manual_seed(seed)
        V, Vp, maxT, L, C = self.V, self.Vp, self.maxT, self.L, self.C
        std = float(np.float32(0.02))
        proj = float(np.float32(0.02 / math.sqrt(2 * L)))
        T = {name: torch.zeros(s) for name, s in shapes(V, Vp, maxT, L, C)}
        T["wte"][:V] = torch.randn(V, C, generator=g) * std
        T["wpe"][:] = torch.randn(maxT, C, generator=g) * std
        for k, s in (("qkvw", std), ("attprojw", proj), ("fcw", std), ("fcprojw", proj)):
            T[k][:] = torch.randn(T[k].shape, generator=g) * s
        for k in ("ln1w", "ln2w", "lnfw"):
            T[k].fill_(1.0)
        self.load_llmc_tensors(T)


def read_llmc_checkpoint(path):
    with open(path, "rb") as fh:
        hdr = np.frombuffer(fh.read(4 * HEADER_INTS), dtype="<i4")
        if len(hdr) != HEADER_INTS or hdr[0] != MODEL_MAGIC:
            sys.exit("%s: not an llm.c model file" % path)
        if hdr[1] != MODEL_VERSION_FP32:
            sys.exit("%s: version %d, only fp32 (3) is read" % (path, hdr[1]))
        maxT, V, L, H, C, Vp = (int(x) for x in hdr[2:8])
        sh = shapes(V, Vp, maxT, L, C)
        n = sum(int(np.prod(s)) for _, s in sh)
        data = np.frombuffer(fh.read(), dtype="<f4")
    if data.size != n:
        sys.exit("%s: %d floats, header says %d" % (path, data.size, n))
    T, off = {}, 0
    for name, s in sh:
        k = int(np.prod(s))
        T[name] = torch.from_numpy(data[off:off + k].reshape(s).copy())
        off += k
    return dict(V=V, Vp=Vp, maxT=maxT, L=L, H=H, C=C), T


def write_llmc_checkpoint(path, model):
    m = model
    hdr = np.zeros(HEADER_INTS, dtype="<i4")
    hdr[:8] = [MODEL_MAGIC, MODEL_VERSION_FP32, m.maxT, m.V, m.L, m.H, m.C, m.Vp]
    T = m.llmc_tensors()
    with open(path, "wb") as fh:
        fh.write(hdr.tobytes())
        for name, s in shapes(m.V, m.Vp, m.maxT, m.L, m.C):
            assert tuple(T[name].shape) == s, name
            fh.write(T[name].float().contiguous().numpy().astype("<f4").tobytes())


def read_tokens(path):
    raw = np.fromfile(path, dtype=np.uint8)
    hdr = raw[:4 * HEADER_INTS].view("<i4")
    if len(hdr) != HEADER_INTS or hdr[0] != TOKENS_MAGIC or hdr[1] != TOKENS_VERSION:
        sys.exit("%s: not an llm.c token file" % path)
    n = int(hdr[2])
    if raw.size != 4 * HEADER_INTS + 2 * n:
        sys.exit("%s: size %d, header says %d tokens" % (path, raw.size, n))
    return raw[4 * HEADER_INTS:].view("<u2").astype(np.int64)


class Batches:
    def __init__(self, tokens, B, T):
        if tokens.size < B * T + 1:
            sys.exit("token file holds %d tokens, one batch needs %d" % (tokens.size, B * T + 1))
        self.tokens, self.B, self.T, self.pos = tokens, B, T, 0

    def next(self):
        n = self.B * self.T
        if self.pos + n + 1 > self.tokens.size:
            self.pos = 0
        chunk = torch.from_numpy(self.tokens[self.pos:self.pos + n + 1])
        self.pos += n
        return chunk[:-1].view(self.B, self.T), chunk[1:].view(self.B, self.T)


def parse_args():
    ap = argparse.ArgumentParser(description="GPT-2 training step timing with PyTorch (CPU)")
    ap.add_argument("--V", type=int, default=50257)
    ap.add_argument("--Vp", type=int, default=50304)
    ap.add_argument("--maxT", type=int, default=1024)
    ap.add_argument("--L", type=int, default=12)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--C", type=int, default=768)
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--wd", type=float, default=0.0)
    impl = ap.add_mutually_exclusive_group()
    impl.add_argument("--foreach", action="store_true", help="AdamW foreach=True")
    impl.add_argument("--fused", action="store_true", help="AdamW fused=True")
    impl.add_argument("--forloop", action="store_true", help="AdamW foreach=False")
    ap.add_argument("--tokens", help="llm.c token file (default: random tokens from --seed)")
    ap.add_argument("--llmc-checkpoint", help="start from this llm.c model file")
    ap.add_argument("--write-llmc-checkpoint", help="write the starting weights here")
    ap.add_argument("--checkpointing", action="store_true", help="recompute each block in backward")
    ap.add_argument("--bf16", action="store_true", help="autocast the forward to bfloat16")
    ap.add_argument("--adamw8", action="store_true", help="bitsandbytes AdamW8bit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="train on the CPU or the GPU")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="optimizer step per parameter in backward, gradients freed at once")
    a = ap.parse_args()
    if a.steps < 1 or a.warmup < 0 or a.threads < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --threads >= 1")
    if a.adamw8 and (a.foreach or a.fused or a.forloop):
        ap.error("--adamw8 has no --foreach/--fused/--forloop")
    return a


def main():
    a = parse_args()
    torch.set_num_threads(a.threads)

    if a.llmc_checkpoint:
        shape, tensors = read_llmc_checkpoint(a.llmc_checkpoint)
        for k, v in shape.items():
            setattr(a, k, v)
    if a.C % a.H or a.Vp < a.V or not 0 < a.T <= a.maxT:
        sys.exit("bad shape: need H | C, V <= Vp, 0 < T <= maxT")

    model = GPT2(a.V, a.Vp, a.maxT, a.L, a.H, a.C, recompute=a.checkpointing)
    if a.llmc_checkpoint:
        model.load_llmc_tensors(tensors)
        del tensors
    else:
        model.init_gpt2(a.seed)
    if a.write_llmc_checkpoint:
        write_llmc_checkpoint(a.write_llmc_checkpoint, model)
    model.to(a.device)
    nparams = sum(p.numel() for p in model.parameters())
    cuda = a.device == "cuda"

    if a.tokens:
        tokens = read_tokens(a.tokens)
        if tokens.size and tokens.max() >= a.V:
            sys.exit("%s: token %d outside the vocabulary (%d)" % (a.tokens, tokens.max(), a.V))
    else:
        g = torch.Generator().manual_seed(a.seed + 1)
        ntok = (a.warmup + a.steps) * a.B * a.T + 1
        tokens = torch.randint(0, a.V, (ntok,), generator=g).numpy()
    data = Batches(tokens, a.B, a.T)

    kw = dict(lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.wd)
    impl = "default"
    if a.foreach:
        kw["foreach"], impl = True, "foreach"
    elif a.fused:
        kw["fused"], impl = True, "fused"
    elif a.forloop:
        kw["foreach"], impl = False, "forloop"
    if a.adamw8:
        import bitsandbytes as bnb
        make_opt, impl = (lambda ps: bnb.optim.AdamW8bit(ps, min_8bit_size=4096, **kw)), "bnb-8bit"
    else:
        make_opt = lambda ps: torch.optim.AdamW(ps, **kw)
    if a.step_in_backward:
        per_param = {p: make_opt([p]) for p in model.parameters()}

        def step_hook(p):
            per_param[p].step()
            per_param[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_hook)
        opt = None
    else:
        opt = make_opt(model.parameters())

    losses, times = [], []
    for step in range(a.warmup + a.steps):
        x, y = data.next()
        x, y = x.to(a.device), y.to(a.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        if a.bf16:
            with torch.autocast(a.device, dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        if opt is not None:
            opt.step()
        lv = loss.item()
        t1 = time.perf_counter()
        losses.append(lv)
        if step >= a.warmup:
            times.append(1e3 * (t1 - t0))

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    extra = {}
    if cuda:
        extra = {"device": torch.cuda.get_device_name(),
                 "peak_device_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
                 "peak_device_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}
    print(json.dumps({
        "impl": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "B": a.B, "T": a.T, "params": nparams,
        "ms_per_step_median": round(statistics.median(times), 3),
        "ms_per_step_min": round(min(times), 3),
        "peak_rss_mib": round(peak / 1024.0, 1),
        "rss_before_model_mib": round(RSS_AFTER_IMPORT_KIB / 1024.0, 1),
        "losses": [round(v, 6) for v in losses],
        "steps": a.steps, "warmup": a.warmup,
        "config": {"V": a.V, "Vp": a.Vp, "maxT": a.maxT, "L": a.L, "H": a.H, "C": a.C},
        "optimizer": "adamw8" if a.adamw8 else "adamw", "optimizer_impl": impl,
        "step_in_backward": a.step_in_backward, "lr": a.lr, "weight_decay": a.wd,
        "checkpointing": a.checkpointing, "bf16": a.bf16,
        "init": a.llmc_checkpoint or ("gpt2 seed=%d" % a.seed),
        "data": a.tokens or ("random seed=%d" % (a.seed + 1)),
        **extra,
    }))


if __name__ == "__main__":
    main()
