// llmc OpenCL backend: every kernel except the SGEMM (sgemm.cl), float32.
//
// Buffers are passed as (base pointer, element offset) pairs so that views carved out of one allocation
// need no sub-buffers (whose alignment rules would forbid arbitrary offsets). Row-wise reductions use one
// work-group of RED_LS work-items per row and a fixed tree in local memory: results never depend on
// scheduling, and nothing uses floating-point atomics.

#pragma OPENCL FP_CONTRACT OFF

#ifndef RED_LS
#define RED_LS 256
#endif

#define GELU_SCALING_FACTOR 0.7978845608028654f

// tree-reduce `v` over the work-group (RED_LS items, power of two); every item gets the result
inline float group_sum(float v, __local float* scratch) {
    const int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    scratch[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_LS / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] += scratch[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return scratch[0];
}

inline float group_max(float v, __local float* scratch) {
    const int lid = get_local_id(0);
    barrier(CLK_LOCAL_MEM_FENCE);
    scratch[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = RED_LS / 2; s > 0; s >>= 1) {
        if (lid < s) scratch[lid] = fmax(scratch[lid], scratch[lid + s]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return scratch[0];
}

// ---- memory / elementwise ----------------------------------------------------------------------------------
__kernel void fill_f32(__global float* x, const long xo, const long n, const float value) {
    const long i = get_global_id(0);
    if (i < n) x[xo + i] = value;
}

__kernel void fill_i32(__global int* x, const long xo, const long n, const int value) {
    const long i = get_global_id(0);
    if (i < n) x[xo + i] = value;
}

__kernel void scale_f32(__global float* x, const long xo, const long n, const float factor) {
    const long i = get_global_id(0);
    if (i < n) x[xo + i] *= factor;
}

__kernel void residual_forward(__global float* out, const long oo, __global const float* a, const long ao,
                               __global const float* b, const long bo, const long n) {
    const long i = get_global_id(0);
    if (i < n) out[oo + i] = a[ao + i] + b[bo + i];
}

__kernel void gelu_forward(__global float* out, const long oo, __global const float* inp, const long io,
                           const long n) {
    const long i = get_global_id(0);
    if (i >= n) return;
    const float x = inp[io + i];
    const float cube = 0.044715f * x * x * x;
    out[oo + i] = 0.5f * x * (1.0f + tanh(GELU_SCALING_FACTOR * (x + cube)));
}

__kernel void gelu_backward(__global float* dinp, const long dio, __global const float* inp, const long io,
                            __global const float* dout, const long doo, const long n) {
    const long i = get_global_id(0);
    if (i >= n) return;
    const float x = inp[io + i];
    const float cube = 0.044715f * x * x * x;
    const float t = tanh(GELU_SCALING_FACTOR * (x + cube));
    const float sech2 = 1.0f - t * t;
    const float lg = 0.5f * (1.0f + t) + x * 0.5f * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[dio + i] = lg * dout[doo + i];
}

// inp (N,2H) = [gate | up]; out (N,H)
__kernel void swiglu_forward(__global float* out, const long oo, __global const float* inp, const long io,
                             const int H, const long n) {
    const long i = get_global_id(0);
    if (i >= n) return;
    const long r = i / H, j = i % H;
    const float g = inp[io + r * 2 * H + j], u = inp[io + r * 2 * H + H + j];
    out[oo + i] = g / (1.0f + exp(-g)) * u;
}

__kernel void swiglu_backward(__global float* dinp, const long dio, __global const float* dout, const long doo,
                              __global const float* inp, const long io, const int H, const long n) {
    const long i = get_global_id(0);
    if (i >= n) return;
    const long r = i / H, j = i % H;
    const float g = inp[io + r * 2 * H + j], u = inp[io + r * 2 * H + H + j];
    const float d = dout[doo + i];
    const float sig = 1.0f / (1.0f + exp(-g));
    const float silu = g * sig;
    dinp[dio + r * 2 * H + H + j] = d * silu;
    dinp[dio + r * 2 * H + j] = d * u * (sig + silu * (1.0f - sig));
}

// qkv (B,T,W), rotate q and k heads (NQK = NH + NKV of them) in place; freqs (maxT, hd/2, 2) = (cos, sin)
__kernel void rope(__global float* qkv, const long qo, __global const float* freqs, const long fo,
                   const int T, const int W, const int NQK, const int hd, const float sign, const long n) {
    const long i = get_global_id(0);  // over B*T*NQK*(hd/2)
    if (i >= n) return;
    const int hd2 = hd / 2;
    const int p = i % hd2;
    const long rest = i / hd2;
    const int h = rest % NQK;
    const long bt = rest / NQK;
    const int t = bt % T;
    const long base = qo + bt * W + h * hd + 2 * p;
    const float c = freqs[fo + ((long)t * hd2 + p) * 2];
    const float s = sign * freqs[fo + ((long)t * hd2 + p) * 2 + 1];
    const float x0 = qkv[base], x1 = qkv[base + 1];
    qkv[base] = x0 * c - x1 * s;
    qkv[base + 1] = x0 * s + x1 * c;
}

// ---- encoder ------------------------------------------------------------------------------------------------
__kernel void encoder_forward(__global float* out, const long oo, __global const int* inp, const long io,
                              __global const float* wte, const long teo, __global const float* wpe,
                              const long peo, const int has_wpe, const int T, const int C, const long n) {
    const long i = get_global_id(0);  // over N*C
    if (i >= n) return;
    const long r = i / C;
    const int c = i % C;
    const int t = r % T;
    const float e = wte[teo + (long)inp[io + r] * C + c];
    out[oo + i] = has_wpe ? e + wpe[peo + (long)t * C + c] : e;
}

// Rows of dout grouped by token (a stable sort: `order` lists row indices token by token, segment u covering
// order[seg[u]] .. order[seg[u+1]-1], all with token tok[u]). One work-item per (channel, token) adds that
// token's rows in their original order: deterministic, no atomics, same order as a sequential scatter-add.
__kernel void encoder_backward_wte(__global float* dwte, const long dwo, __global const float* dout,
                                   const long doo, __global const int* order, __global const int* seg,
                                   __global const int* tok, const int C, const int U) {
    const int c = get_global_id(0);
    const int u = get_global_id(1);
    if (c >= C || u >= U) return;
    const long dst = dwo + (long)tok[u] * C + c;
    float v = dwte[dst];
    for (int i = seg[u]; i < seg[u + 1]; i++) v += dout[doo + (long)order[i] * C + c];
    dwte[dst] = v;
}

__kernel void encoder_backward_wpe(__global float* dwpe, const long dwo, __global const float* dout,
                                   const long doo, const int B, const int T, const int C) {
    const long i = get_global_id(0);  // over T*C
    if (i >= (long)T * C) return;
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += dout[doo + (long)b * T * C + i];
    dwpe[dwo + i] += s;
}

// ---- column sums (parameter gradients), in two deterministic stages ------------------------------------------
// partial[k, c] = sum over rows k*R .. k*R+R-1 of x[r, c]
__kernel void colsum_partial(__global float* partial, __global const float* x, const long xo, const int Nr,
                             const int C, const int R) {
    const int c = get_global_id(0), k = get_global_id(1);
    if (c >= C) return;
    const int r1 = min(Nr, (k + 1) * R);
    float s = 0.0f;
    for (int r = k * R; r < r1; r++) s += x[xo + (long)r * C + c];
    partial[(long)k * C + c] = s;
}

// out[c] += sum_k partial[k, c], k in order
__kernel void colsum_finish(__global float* out, const long oo, __global const float* partial, const int nk,
                            const int C) {
    const int c = get_global_id(0);
    if (c >= C) return;
    float s = 0.0f;
    for (int k = 0; k < nk; k++) s += partial[(long)k * C + c];
    out[oo + c] += s;
}

// ---- layernorm ----------------------------------------------------------------------------------------------
// One work-group per row. With `fuse`, x = a + b2 is also written to `residual` (the fused residual add).
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void layernorm_forward(__global float* out, const long oo, __global float* mean, const long mo,
                       __global float* rstd, const long ro, __global const float* inp, const long io,
                       __global const float* inp2, const long i2o, __global float* residual, const long reso,
                       const int fuse, __global const float* w, const long wo, __global const float* bias,
                       const long bo, const int C) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* x = inp + io + row * C;
    __global const float* x2 = inp2 + i2o + row * C;
    float s = 0.0f;
    for (int c = lid; c < C; c += RED_LS) s += fuse ? x[c] + x2[c] : x[c];
    const float m = group_sum(s, scratch) / C;
    float v = 0.0f;
    for (int c = lid; c < C; c += RED_LS) {
        const float d = (fuse ? x[c] + x2[c] : x[c]) - m;
        v += d * d;
    }
    const float var = group_sum(v, scratch) / C;
    const float r = 1.0f / sqrt(var + 1e-5f);
    for (int c = lid; c < C; c += RED_LS) {
        const float xi = fuse ? x[c] + x2[c] : x[c];
        if (fuse) residual[reso + row * C + c] = xi;
        out[oo + row * C + c] = (xi - m) * r * w[wo + c] + bias[bo + c];
    }
    if (lid == 0) {
        mean[mo + row] = m;
        rstd[ro + row] = r;
    }
}

// dinp (N,C) += ...; one work-group per row
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void layernorm_backward_dinp(__global float* dinp, const long dio, __global const float* dout, const long doo,
                             __global const float* inp, const long io, __global const float* w, const long wo,
                             __global const float* mean, const long mo, __global const float* rstd,
                             const long ro, const int C) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int lid = get_local_id(0);
    const float m = mean[mo + row], r = rstd[ro + row];
    __global const float* x = inp + io + row * C;
    __global const float* g = dout + doo + row * C;
    float s1 = 0.0f, s2 = 0.0f;
    for (int c = lid; c < C; c += RED_LS) {
        const float xhat = (x[c] - m) * r;
        const float dn = g[c] * w[wo + c];
        s1 += dn;
        s2 += dn * xhat;
    }
    const float dnorm_mean = group_sum(s1, scratch) / C;
    const float dnorm_norm_mean = group_sum(s2, scratch) / C;
    for (int c = lid; c < C; c += RED_LS) {
        const float xhat = (x[c] - m) * r;
        const float dn = g[c] * w[wo + c];
        dinp[dio + row * C + c] += ((dn - dnorm_mean) - xhat * dnorm_norm_mean) * r;
    }
}

// partials for dweight (pw) and dbias (pb): rows k*R .. k*R+R-1; mean == 0 / no pb for rmsnorm (is_rms)
__kernel void norm_dparams_partial(__global float* pw, __global float* pb, __global const float* dout,
                                   const long doo, __global const float* inp, const long io,
                                   __global const float* mean, const long mo, __global const float* rstd,
                                   const long ro, const int is_rms, const int Nr, const int C, const int R) {
    const int c = get_global_id(0), k = get_global_id(1);
    if (c >= C) return;
    const int r1 = min(Nr, (k + 1) * R);
    float sw = 0.0f, sb = 0.0f;
    for (int r = k * R; r < r1; r++) {
        const float g = dout[doo + (long)r * C + c];
        const float x = inp[io + (long)r * C + c];
        const float xhat = is_rms ? x * rstd[ro + r] : (x - mean[mo + r]) * rstd[ro + r];
        sw += g * xhat;
        sb += g;
    }
    pw[(long)k * C + c] = sw;
    if (!is_rms) pb[(long)k * C + c] = sb;
}

// ---- rmsnorm ------------------------------------------------------------------------------------------------
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void rmsnorm_forward(__global float* out, const long oo, __global float* rstd, const long ro,
                     __global const float* inp, const long io, __global const float* w, const long wo,
                     const float eps, const int C) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int lid = get_local_id(0);
    __global const float* x = inp + io + row * C;
    float s = 0.0f;
    for (int c = lid; c < C; c += RED_LS) s += x[c] * x[c];
    const float ms = group_sum(s, scratch) / C;
    const float r = 1.0f / sqrt(ms + eps);
    for (int c = lid; c < C; c += RED_LS) out[oo + row * C + c] = x[c] * r * w[wo + c];
    if (lid == 0) rstd[ro + row] = r;
}

__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void rmsnorm_backward_dinp(__global float* dinp, const long dio, __global const float* dout, const long doo,
                           __global const float* inp, const long io, __global const float* w, const long wo,
                           __global const float* rstd, const long ro, const int C) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int lid = get_local_id(0);
    const float r = rstd[ro + row];
    __global const float* x = inp + io + row * C;
    __global const float* g = dout + doo + row * C;
    float s = 0.0f;
    for (int c = lid; c < C; c += RED_LS) s += g[c] * w[wo + c] * (x[c] * r);
    const float dot = group_sum(s, scratch) / C;
    for (int c = lid; c < C; c += RED_LS) {
        const float dn = g[c] * w[wo + c];
        dinp[dio + row * C + c] += (dn - (x[c] * r) * dot) * r;
    }
}

// ---- attention softmax pieces (the matmuls go through sgemm) ------------------------------------------------
// S (Z, T, T) scaled scores, rows t; only j <= t are valid. P = softmax(S) in place (zeros above the
// diagonal) and lse[z*T + t]. One work-group per row (z, t): group id = z*T + t.
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void attn_softmax_forward(__global float* S, const long so, __global float* lse, const long lo, const int T) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int t = row % T;
    const int lid = get_local_id(0);
    __global float* s = S + so + row * T;
    float m = -INFINITY;
    for (int j = lid; j <= t; j += RED_LS) m = fmax(m, s[j]);
    m = group_max(m, scratch);
    float sum = 0.0f;
    for (int j = lid; j <= t; j += RED_LS) sum += exp(s[j] - m);
    sum = group_sum(sum, scratch);
    const float l = m + log(sum);
    for (int j = lid; j < T; j += RED_LS) s[j] = j <= t ? exp(s[j] - l) : 0.0f;
    if (lid == 0) lse[lo + row] = l;
}

// Backward: P = exp(S - lse) recomputed in place from the scores
__kernel void attn_probs_from_lse(__global float* S, const long so, __global const float* lse, const long lo,
                                  const int T, const long n) {
    const long i = get_global_id(0);  // over Z*T*T
    if (i >= n) return;
    const long row = i / T;
    const int j = i % T, t = row % T;
    S[so + i] = j <= t ? exp(S[so + i] - lse[lo + row]) : 0.0f;
}

// dS = P * (dP - D) * scale in place over dP, D = sum_d dO*O of the row; zeros above the diagonal.
// dO and O rows live in (B,T,NH*hd) tensors: row (z=b*NH+h, t) at ((b*T + t)*NH + h)*hd.
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void attn_softmax_backward(__global float* dP, const long dpo, __global const float* P, const long po,
                           __global const float* dout, const long doo, __global const float* out,
                           const long oo, const int T, const int NH, const int hd, const float scale) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);  // z*T + t, z counted from the chunk start
    const int t = row % T;
    const long z = row / T;
    const long b = z / NH;
    const int h = z % NH;
    const int lid = get_local_id(0);
    const long ro = ((b * T + t) * NH + h) * hd;
    float d = 0.0f;
    for (int k = lid; k < hd; k += RED_LS) d += dout[doo + ro + k] * out[oo + ro + k];
    d = group_sum(d, scratch);
    __global float* dp = dP + dpo + row * T;
    __global const float* p = P + po + row * T;
    for (int j = lid; j < T; j += RED_LS) dp[j] = j <= t ? p[j] * (dp[j] - d) * scale : 0.0f;
}

// GQA: dst[b, t, kvh*hd + d] (row stride W) = sum_{i<g} src[b, kvh*g + i, t, d], src (B, NH, T, hd)
__kernel void attn_group_sum(__global float* dst, const long dso, const int W, __global const float* src,
                             const long so, const int T, const int NH, const int NKV, const int hd,
                             const long n) {
    const long i = get_global_id(0);  // over B*T*NKV*hd
    if (i >= n) return;
    const int d = i % hd;
    long rest = i / hd;
    const int kvh = rest % NKV;
    rest /= NKV;
    const int t = rest % T;
    const long b = rest / T;
    const int g = NH / NKV;
    float s = 0.0f;
    for (int j = 0; j < g; j++) s += src[so + (((b * NH + kvh * g + j) * T) + t) * hd + d];
    dst[dso + (b * T + t) * W + kvh * hd + d] = s;
}

// ---- attention over a key/value cache (decoding) -------------------------------------------------------------
// Caches (B,NKV,S,hd) are rings: position p lives in slot p % S. New tokens' qkv rows are (B,Tn,(NH+2NKV)*hd).
#define DECODE_MAX_HD 256
#define DECODE_PER_ITEM ((DECODE_MAX_HD + RED_LS - 1) / RED_LS)

__kernel void kv_cache_append(__global float* kc, const long ko, __global float* vc, const long vo,
                              __global const float* qkv, const long qo, const int Tn, const int NH, const int NKV,
                              const int hd, const int S, const long pos, const long n) {
    const long i = get_global_id(0);  // over B*Tn*NKV*hd
    if (i >= n) return;
    const int d = i % hd;
    long r = i / hd;
    const int h = r % NKV;
    r /= NKV;
    const int t = r % Tn;
    const long b = r / Tn;
    const long src = qo + (b * Tn + t) * (long)((NH + 2 * NKV) * hd);
    const long dst = ((b * NKV + h) * S + (pos + t) % S) * hd + d;
    kc[ko + dst] = qkv[src + (NH + h) * hd + d];
    vc[vo + dst] = qkv[src + (NH + NKV + h) * hd + d];
}

// One work-group per query row (b, h, t): an online softmax over the positions it sees (the S up to its own),
// RED_LS keys at a time; item lid accumulates output elements d0 + lid, d0 + lid + RED_LS, ... of the at most
// DECODE_MAX_HD from d0 on: a head larger than that takes one launch per DECODE_MAX_HD of its output (each
// scores the keys again), with the query row read from global memory instead of local memory.
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void attention_decode(__global float* out, const long oo, __global const float* qkv, const long qo,
                      __global const float* kc, const long ko, __global const float* vc, const long vo,
                      const int Tn, const int NH, const int NKV, const int hd, const int S, const long pos,
                      const float scale, const int d0) {
    __local float scratch[RED_LS];
    __local float p[RED_LS];
    __local float q[DECODE_MAX_HD];
    const long row = get_group_id(0);
    const int t = row % Tn;
    const int h = (row / Tn) % NH;
    const long b = row / ((long)Tn * NH);
    const int lid = get_local_id(0);
    const int W = (NH + 2 * NKV) * hd;
    const int kvh = h / (NH / NKV);
    __global const float* qg = qkv + qo + (b * Tn + t) * W + h * hd;
    const int qloc = hd <= DECODE_MAX_HD;  // the query row fits local memory
    const int dn = min(hd - d0, DECODE_MAX_HD);  // output elements d0 .. d0 + dn - 1 in this launch
    if (qloc)
        for (int d = lid; d < hd; d += RED_LS) q[d] = qg[d] * scale;
    barrier(CLK_LOCAL_MEM_FENCE);
    const long hi = pos + t;
    const long lo = hi - S + 1 > 0 ? hi - S + 1 : 0;
    const int n = (int)(hi - lo + 1);
    __global const float* K = kc + ko + (b * NKV + kvh) * (long)S * hd;
    __global const float* V = vc + vo + (b * NKV + kvh) * (long)S * hd;
    float acc[DECODE_PER_ITEM];
    for (int i = 0; i < DECODE_PER_ITEM; i++) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 < n; j0 += RED_LS) {
        const int j = j0 + lid;
        float s = -INFINITY;
        if (j < n) {
            __global const float* k = K + ((lo + j) % S) * hd;
            float dot = 0.0f;
            if (qloc)
                for (int c = 0; c < hd; c++) dot += q[c] * k[c];
            else
                for (int c = 0; c < hd; c++) dot += (qg[c] * scale) * k[c];
            s = dot;
        }
        const float mn = fmax(m, group_max(s, scratch));  // finite: every tile holds at least one position
        const float e = j < n ? exp(s - mn) : 0.0f;
        p[lid] = e;
        const float corr = exp(m - mn);
        l = l * corr + group_sum(e, scratch);  // (its barriers also publish p)
        const int cnt = min(RED_LS, n - j0);
        for (int i = 0, d = lid; d < dn; i++, d += RED_LS) {
            float a = acc[i] * corr;
            for (int jj = 0; jj < cnt; jj++) a += p[jj] * V[((lo + j0 + jj) % S) * hd + d0 + d];
            acc[i] = a;
        }
        m = mn;
        barrier(CLK_LOCAL_MEM_FENCE);  // the next tile rewrites p
    }
    for (int i = 0, d = lid; d < dn; i++, d += RED_LS) out[oo + (b * Tn + t) * NH * hd + h * hd + d0 + d] = acc[i] / l;
}

// ---- fused classifier ---------------------------------------------------------------------------------------
// One work-group per row. losses[r] = logsumexp(logits[r, :V]) - logits[r, target]; with has_d, logits is
// overwritten by (softmax - onehot) * dloss, zero in the padded columns.
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void classifier_forward_backward(__global float* logits, const long lo, __global float* losses, const long lso,
                                 __global const int* targets, const long to, const int V, const int Vp,
                                 const int has_d, const float dloss) {
    __local float scratch[RED_LS];
    const long row = get_group_id(0);
    const int lid = get_local_id(0);
    __global float* x = logits + lo + row * Vp;
    const int tgt = targets[to + row];
    float m = -INFINITY;
    for (int j = lid; j < V; j += RED_LS) m = fmax(m, x[j]);
    m = group_max(m, scratch);
    float s = 0.0f, c = 0.0f;  // compensated: on a CPU device one item sums all V (50k+) terms
    for (int j = lid; j < V; j += RED_LS) {
        const float y = exp(x[j] - m) - c;
        const float t = s + y;
        c = (t - s) - y;
        s = t;
    }
    s = group_sum(s, scratch);
    const float xt = (tgt >= 0 && tgt < V) ? x[tgt] : NAN;
    if (lid == 0) losses[lso + row] = log(s) + m - xt;
    barrier(CLK_GLOBAL_MEM_FENCE);  // every item has read x[tgt] before anyone overwrites it
    const float f = dloss / s;
    for (int j = lid; has_d && j < Vp; j += RED_LS) {
        float d = 0.0f;
        if (j < V) {
            d = exp(x[j] - m) * f;
            if (j == tgt) d -= dloss;
        }
        x[j] = d;
    }
}

// ---- optimizer ----------------------------------------------------------------------------------------------
// partial[slot + group] = sum of squares of the group's share of x[0..n). Each lane keeps a compensated
// (Kahan) sum: a lane adds up to millions of squares, and a plain float32 running sum of that many positive
// terms drifts by ~1e-3 relative (the CPU reference sums in float64); the compensation keeps it near 1e-7.
__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void sumsq_partial(__global float* partial, const int slot, __global const float* x, const long xo,
                   const long n) {
    __local float scratch[RED_LS];
    float s = 0.0f, c = 0.0f;
#if RED_LS == 1
    // CPU devices (one item per group): each group sums one contiguous chunk, 8 lanes then a fixed tree
    const long G = get_num_groups(0);
    const long chunk = ((n + G - 1) / G + 7) / 8 * 8;
    const long beg = get_group_id(0) * chunk, end = min(n, beg + chunk);
    float8 s8 = (float8)(0.0f), c8 = (float8)(0.0f);
    long i = beg;
    for (; i + 8 <= end; i += 8) {
        const float8 v = vload8(0, x + xo + i);
        const float8 y = v * v - c8;
        const float8 t = s8 + y;
        c8 = (t - s8) - y;
        s8 = t;
    }
    for (; i < end; i++) {
        const float y = x[xo + i] * x[xo + i] - c;
        const float t = s + y;
        c = (t - s) - y;
        s = t;
    }
    s += ((s8.s0 + s8.s1) + (s8.s2 + s8.s3)) + ((s8.s4 + s8.s5) + (s8.s6 + s8.s7));
#else
    const long stride = (long)get_num_groups(0) * RED_LS;
    for (long i = get_global_id(0); i < n; i += stride) {
        const float v = x[xo + i];
        const float y = v * v - c;
        const float t = s + y;
        c = (t - s) - y;
        s = t;
    }
#endif
    s = group_sum(s, scratch);
    if (get_local_id(0) == 0) partial[slot + get_group_id(0)] = s;
}

__kernel __attribute__((reqd_work_group_size(RED_LS, 1, 1)))
void sum_final(__global float* out, const long oo, __global const float* partial, const int n) {
    __local float scratch[RED_LS];
    float s = 0.0f;
    for (int i = get_local_id(0); i < n; i += RED_LS) s += partial[i];
    s = group_sum(s, scratch);
    if (get_local_id(0) == 0) out[oo] = s;
}

// same operation order as the CPU reference (torch.optim.AdamW: decay, moments, addcdiv); with `mirror`,
// the updated master value is also written into param
__kernel void adamw_update(__global float* p, const long po, __global const float* g, const long go,
                           __global float* m, const long mo, __global float* v, const long vo,
                           __global float* mirror, const long mro, const int has_mirror, const long n,
                           const float step_size, const float rbc2, const float decay, const int do_decay,
                           const float b1, const float b2, const float c1, const float c2, const float eps) {
    const long i = get_global_id(0);
    if (i >= n) return;
    float pi = p[po + i];
    const float gi = g[go + i];
    if (do_decay) pi *= decay;
    const float mi = m[mo + i] * b1 + gi * c1;
    const float vi = v[vo + i] * b2 + (gi * gi) * c2;
    const float denom = sqrt(vi) * rbc2 + eps;
    pi -= (mi / denom) * step_size;
    m[mo + i] = mi;
    v[vo + i] = vi;
    p[po + i] = pi;
    if (has_mirror) mirror[mro + i] = pi;
}

// ---- split-K SGEMM (CPU devices) -------------------------------------------------------------------------------
// C (M,N) [+]= alpha * sum_z P[z] (M,N) with sgemm's epilogues (bias, GELU fwd/bwd); the partial products P[z]
// come from a batched sgemm over consecutive K chunks, summed here in a fixed order (deterministic).
__kernel void splitk_reduce(__global float* C, const long c_off, const int ldc, __global const float* P,
                            const int S, const int M, const int N, const float alpha, const int accumulate,
                            __global const float* bias, const long bias_off, const int has_bias,
                            __global float* aux, const long aux_off, const int epi) {
    const long i = get_global_id(0);
    const long MN = (long)M * N;
    if (i >= MN) return;
    const int m = i / N, n = i % N;
    float s = 0.0f;
    for (int z = 0; z < S; z++) s += P[z * MN + i];
    const long idx = c_off + (long)m * ldc + n;
    const long ai = aux_off + (long)m * ldc + n;
    float v = alpha * s;
    if (accumulate) v += C[idx];
    if (has_bias) v += bias[bias_off + n];
    if (epi == 1) {
        C[idx] = v;
        const float cube = 0.044715f * v * v * v;
        aux[ai] = 0.5f * v * (1.0f + tanh(GELU_SCALING_FACTOR * (v + cube)));
    } else if (epi == 2) {
        const float x = aux[ai];
        const float cube = 0.044715f * x * x * x;
        const float t = tanh(GELU_SCALING_FACTOR * (x + cube));
        const float sech2 = 1.0f - t * t;
        const float lg = 0.5f * (1.0f + t) + x * 0.5f * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
        C[idx] = v * lg;
    } else {
        C[idx] = v;
    }
}
