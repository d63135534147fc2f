"""The Triton kernels of live_attention (imported only where triton is): per (row, KV head, chunk) a partial
output and its log-sum-exp over the chunk's live columns, then their merge per (row, query head)."""

import triton
import triton.language as tl


@triton.jit
def _block(q, m, l, acc, kbase, vbase, n0, lo, hi, d, dmask, sk_n, sv_n, scale_log2, BLOCK_N: tl.constexpr,
           PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """Online softmax over columns [n0, n0 + BLOCK_N) inside [lo, hi), for the GROUP query rows of q."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = (n >= lo) & (n < hi)
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(kbase + n[:, None] * sk_n + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(vbase + n[:, None] * sv_n + d[None, :], mask=kv_mask, other=0.0)
    if INTERPRET:  # the interpreter's bf16/fp16 dots are wrong: fp32 there
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, 1))  # finite: the block holds a live column
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def partials(Q, K, V, START, POS, O_PART, LSE_PART, sq_r, sq_h, sk_r, sk_h, sk_n, sv_r, sv_h, sv_n,
             scale_log2, heads, splits, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, DIM: tl.constexpr,
             BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
             INTERPRET: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # row offsets can pass 2**31 elements
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    t = tl.load(POS).to(tl.int32)
    start = tl.minimum(tl.load(START + r).to(tl.int32), t)  # a free row's stale start: still one column
    lo = tl.maximum(s * CHUNK, start)
    hi = tl.minimum((s + 1) * CHUNK, t + 1)
    if lo < hi:  # else this chunk holds none of the row's live columns: nothing to read or write
        g = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        hmask = g < GROUP
        dmask = d < DIM
        head = kvh * GROUP + g
        q = tl.load(Q + r * sq_r + head[:, None] * sq_h + d[None, :], mask=hmask[:, None] & dmask[None, :],
                    other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        kbase = K + r * sk_r + kvh * sk_h
        vbase = V + r * sv_r + kvh * sv_h
        if INTERPRET:  # it takes no tensor loop bounds: every block of the chunk, those without a live column skipped
            for i in range(CHUNK // BLOCK_N):
                n0 = s * CHUNK + i * BLOCK_N
                if (n0 + BLOCK_N > lo) & (n0 < hi):
                    m, l, acc = _block(q, m, l, acc, kbase, vbase, n0, lo, hi, d, dmask, sk_n, sv_n, scale_log2,
                                       BLOCK_N, PRECISION, INTERPRET)
        else:  # the live blocks only, aligned to BLOCK_N
            for n0 in range(lo // BLOCK_N * BLOCK_N, hi, BLOCK_N):
                m, l, acc = _block(q, m, l, acc, kbase, vbase, n0, lo, hi, d, dmask, sk_n, sv_n, scale_log2,
                                   BLOCK_N, PRECISION, INTERPRET)
        part = (r * heads + head) * splits + s  # [rows, heads, splits] partials
        tl.store(O_PART + part[:, None] * BLOCK_D + d[None, :], acc / l[:, None], mask=hmask[:, None])
        tl.store(LSE_PART + part, m + tl.log2(l), mask=hmask)


@triton.jit
def merge(O_PART, LSE_PART, START, POS, OUT, so_r, so_h, heads, splits, DIM: tl.constexpr,
          BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.load(POS).to(tl.int32)
    start = tl.minimum(tl.load(START + r).to(tl.int32), t)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    # the chunks `partials` wrote (the others hold whatever the allocator left there)
    live = (s < splits) & (tl.maximum(s * CHUNK, start) < tl.minimum((s + 1) * CHUNK, t + 1))
    part = (r * heads + h) * splits + s
    lse = tl.load(LSE_PART + part, mask=live, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(O_PART + part[:, None] * BLOCK_D + d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + r * so_r + h * so_h + d, out.to(OUT.dtype.element_ty), mask=d < DIM)
