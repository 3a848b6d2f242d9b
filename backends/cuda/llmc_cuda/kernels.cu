// llmc CUDA kernels, compiled by NVRTC at run time (see llmc_cuda/backend.py).
// Compiled once per activation dtype: with -DACT_BF16 `act_t` is bfloat16 (stored as its 16 raw bits),
// otherwise float. Statistics, losses, optimizer state and all accumulations are float32.
// No headers: bf16 conversion is done with bit operations so NVRTC needs no include path.
// Backward reductions never use float atomics: every sum has a fixed order (deterministic).

#ifdef ACT_BF16
typedef unsigned short act_t;
__device__ __forceinline__ float to_f(act_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ act_t from_f(float f) {  // round to nearest even
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (act_t)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (act_t)(u >> 16);
}
#else
typedef float act_t;
__device__ __forceinline__ float to_f(act_t x) { return x; }
__device__ __forceinline__ act_t from_f(float f) { return f; }
#endif

typedef unsigned short bf16_t;
__device__ __forceinline__ float bf16_to_f(bf16_t x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ bf16_t f_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// 128-bit packs: 8 bf16 or 4 float per load/store.
#define PACK (16 / sizeof(act_t))
struct __align__(16) pack_t { act_t v[PACK]; };
__device__ __forceinline__ pack_t load_pack(const act_t* p) { return *reinterpret_cast<const pack_t*>(p); }
__device__ __forceinline__ void store_pack(act_t* p, const pack_t& x) { *reinterpret_cast<pack_t*>(p) = x; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// FP8 helpers (--dtype fp8), used by the casts of the FP8 section below and by the producers that write a matmul's
// FP8 operand themselves (the norms, SwiGLU and GELU: see the FP8 section's comment).
#ifdef ACT_BF16
__device__ __forceinline__ float fp8_scale(const unsigned int* amax, int hist_n, int stride, float fmax) {
    unsigned int bits = 0;
    for (int k = 0; k < hist_n; k++) bits = max(bits, amax[(long long)k * stride]);
    float a = __uint_as_float(bits);
    // all zeros: 1; a tiny amax must not overflow the scale (0 * inf would be NaN); NaN stays NaN
    return a > 0.0f ? fminf(fmax / a, 3.0e38f) : (a == 0.0f ? 1.0f : a);
}
// the block's largest m into *observe with one atomic (every thread of the block calls it, once a kernel)
__device__ __forceinline__ void fp8_observe(unsigned int* observe, unsigned int m) {
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    __shared__ unsigned int wm[32];
    if ((threadIdx.x & 31) == 0) wm[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (blockDim.x + 31) / 32; w++) m = max(m, wm[w]);
        if (observe) atomicMax(observe, m);
    }
}
__device__ __forceinline__ unsigned int pack_amax(const pack_t& p, unsigned int m) {
#pragma unroll
    for (int j = 0; j < 8; j++) m = max(m, __float_as_uint(fabsf(to_f(p.v[j]))));
    return m;
}
// two floats to two fp8 bytes (lo in the low byte), round to nearest even, saturating at the largest finite
__device__ __forceinline__ unsigned int fp8x2(float lo, float hi, int e5m2) {
    unsigned short r = 0;
#if LLMC_CC >= 89
    if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#endif  // (below 8.9 the backend never launches these: --dtype fp8 is refused there)
    return r;
}
// the scale from `hist_n` amax words `stride` apart (fp8_scale); block 0's first thread writes its inverse, which the
// matmul dequantizes with
__device__ __forceinline__ float fp8_block_scale(float* inv_scale, const unsigned int* amax, int hist_n, int stride,
                                                 int e5m2) {
    float s = fp8_scale(amax, hist_n, stride, e5m2 ? 57344.0f : 448.0f);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) inv_scale[0] = 1.0f / s;
    return s;
}
struct __align__(8) fp8x8_t { unsigned int x, y; };  // 8 fp8 bytes (no headers: not CUDA's uint2)
__device__ __forceinline__ fp8x8_t fp8_pack8(const pack_t& p, float s, int e5m2) {
    fp8x8_t q;
    q.x = fp8x2(to_f(p.v[0]) * s, to_f(p.v[1]) * s, e5m2) | (fp8x2(to_f(p.v[2]) * s, to_f(p.v[3]) * s, e5m2) << 16);
    q.y = fp8x2(to_f(p.v[4]) * s, to_f(p.v[5]) * s, e5m2) | (fp8x2(to_f(p.v[6]) * s, to_f(p.v[7]) * s, e5m2) << 16);
    return q;
}
#endif

#define GELU_SCALE 0.7978845608028654f
#define LLMC_INF __int_as_float(0x7f800000)
#define LLMC_NAN __int_as_float(0x7fffffff)

__device__ __forceinline__ float gelu_f(float x) {
    float cube = 0.044715f * x * x * x;
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + cube)));
}
__device__ __forceinline__ float gelu_grad_f(float x) {
    float x2 = x * x;
    float th = tanhf(GELU_SCALE * x * (1.0f + 0.044715f * x2));
    float sech2 = 1.0f - th * th;
    return 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x2);
}

// ---------------------------------------------------------------------------------------------------------
// memory: fill, casts
extern "C" __global__ void fill_act(act_t* out, float value, long long n) {
    act_t v = from_f(value);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = v;
}
extern "C" __global__ void fill_i32(int* out, int value, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = value;
}
extern "C" __global__ void cast_f32_to_bf16(bf16_t* out, const float* inp, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = f_to_bf16(inp[i]);
}
extern "C" __global__ void cast_bf16_to_f32(float* out, const bf16_t* inp, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = bf16_to_f(inp[i]);
}

// ---------------------------------------------------------------------------------------------------------
// elementwise (vec != 0: n % PACK == 0 and all pointers 16-byte aligned, each thread moves one 128-bit pack)
extern "C" __global__ void residual_forward(act_t* out, const act_t* a, const act_t* b, long long n, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (vec) {
        for (long long i = i0 * PACK; i < n; i += stride * PACK) {
            pack_t x = load_pack(a + i), y = load_pack(b + i), o;
            #pragma unroll
            for (int k = 0; k < PACK; k++) o.v[k] = from_f(to_f(x.v[k]) + to_f(y.v[k]));
            store_pack(out + i, o);
        }
    } else {
        for (long long i = i0; i < n; i += stride) out[i] = from_f(to_f(a[i]) + to_f(b[i]));
    }
}

extern "C" __global__ void scale_act(act_t* buf, float factor, long long n, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (vec) {
        for (long long i = i0 * PACK; i < n; i += stride * PACK) {
            pack_t x = load_pack(buf + i);
            #pragma unroll
            for (int k = 0; k < PACK; k++) x.v[k] = from_f(to_f(x.v[k]) * factor);
            store_pack(buf + i, x);
        }
    } else {
        for (long long i = i0; i < n; i += stride) buf[i] = from_f(to_f(buf[i]) * factor);
    }
}

__device__ __forceinline__ pack_t gelu_pack(const pack_t& x) {
    pack_t o;
    #pragma unroll
    for (int k = 0; k < PACK; k++) o.v[k] = from_f(gelu_f(to_f(x.v[k])));
    return o;
}
extern "C" __global__ void gelu_forward(act_t* out, const act_t* inp, long long n, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (vec) {
        for (long long i = i0 * PACK; i < n; i += stride * PACK) store_pack(out + i, gelu_pack(load_pack(inp + i)));
    } else {
        for (long long i = i0; i < n; i += stride) out[i] = from_f(gelu_f(to_f(inp[i])));
    }
}

// dinp = gelu'(inp) * dout; dinp may alias dout
extern "C" __global__ void gelu_backward(act_t* dinp, const act_t* inp, const act_t* dout, long long n, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (vec) {
        for (long long i = i0 * PACK; i < n; i += stride * PACK) {
            pack_t x = load_pack(inp + i), g = load_pack(dout + i), o;
            #pragma unroll
            for (int k = 0; k < PACK; k++) o.v[k] = from_f(gelu_grad_f(to_f(x.v[k])) * to_f(g.v[k]));
            store_pack(dinp + i, o);
        }
    } else {
        for (long long i = i0; i < n; i += stride) dinp[i] = from_f(gelu_grad_f(to_f(inp[i])) * to_f(dout[i]));
    }
}

// swiglu: out (N,H) = silu(gate) * up with inp (N,2H) = [gate | up] per row. vec: H a multiple of PACK and the
// buffers 16-byte aligned, PACK elements per thread in 16-byte loads and stores (these kernels are pure bandwidth)
__device__ __forceinline__ float silu_f(float g) { return g / (1.0f + expf(-g)); }
// one pack of a row's output from its gate and up packs (the FP8 producer's kernel takes the same values)
__device__ __forceinline__ pack_t swiglu_pack(const pack_t& g, const pack_t& u) {
    pack_t o;
#pragma unroll
    for (int k = 0; k < PACK; k++) o.v[k] = from_f(silu_f(to_f(g.v[k])) * to_f(u.v[k]));
    return o;
}
extern "C" __global__ void swiglu_forward(act_t* out, const act_t* inp, long long N, int H, int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    if (vec) {
        int hp = H / PACK;
        long long n = N * hp;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
            long long r = i / hp; int h = (int)(i - r * hp) * PACK;
            const act_t* row = inp + r * 2 * H;
            store_pack(out + r * H + h, swiglu_pack(load_pack(row + h), load_pack(row + H + h)));
        }
        return;
    }
    long long n = N * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        long long r = i / H; int h = (int)(i - r * H);
        float g = to_f(inp[r * 2 * H + h]), u = to_f(inp[r * 2 * H + H + h]);
        out[i] = from_f(silu_f(g) * u);
    }
}
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float* dg, float* du) {
    float sig = 1.0f / (1.0f + expf(-g));
    float silu = g * sig;
    *du = d * silu;
    *dg = d * u * (sig + silu * (1.0f - sig));
}
// one pack of a row's [dgate | dup] at (r, h): from inp's gate and up packs and dout's (shared with the FP8 producer)
__device__ __forceinline__ void swiglu_grad_packs(const act_t* dout, const act_t* inp, long long r, int h, int H,
                                                  pack_t& dg, pack_t& du) {
    pack_t g = load_pack(inp + r * 2 * H + h), u = load_pack(inp + r * 2 * H + H + h), d = load_pack(dout + r * H + h);
#pragma unroll
    for (int k = 0; k < PACK; k++) {
        float a, b;
        swiglu_grad(to_f(g.v[k]), to_f(u.v[k]), to_f(d.v[k]), &a, &b);
        dg.v[k] = from_f(a);
        du.v[k] = from_f(b);
    }
}
extern "C" __global__ void swiglu_backward(act_t* dinp, const act_t* dout, const act_t* inp, long long N, int H,
                                           int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    if (vec) {
        int hp = H / PACK;
        long long n = N * hp;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
            long long r = i / hp; int h = (int)(i - r * hp) * PACK;
            pack_t dg, du;
            swiglu_grad_packs(dout, inp, r, h, H, dg, du);
            store_pack(dinp + r * 2 * H + h, dg);
            store_pack(dinp + r * 2 * H + H + h, du);
        }
        return;
    }
    long long n = N * H;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        long long r = i / H; int h = (int)(i - r * H);
        float a, b;
        swiglu_grad(to_f(inp[r * 2 * H + h]), to_f(inp[r * 2 * H + H + h]), to_f(dout[i]), &a, &b);
        dinp[r * 2 * H + H + h] = from_f(b);
        dinp[r * 2 * H + h] = from_f(a);
    }
}

// rope on q and k heads of qkv (B,T,(NH+2NKV)*hd), pairs (2i, 2i+1); freqs (maxT, hd/2, 2) = (cos, sin).
// vec: hd a multiple of PACK and qkv 16-byte aligned, PACK/2 pairs per thread in one 16-byte load and store
extern "C" __global__ void rope_kernel(act_t* qkv, const float* freqs, int B, int T, int NQK, int W, int hd, float sign,
                                       int vec) {
    int half = hd / 2, per = vec ? PACK / 2 : 1, groups = half / per;  // pairs per thread, thread groups per head
    long long n = (long long)B * T * NQK * groups;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        int p0 = (int)(i % groups) * per;
        long long r = i / groups;
        int head = (int)(r % NQK);
        long long bt = r / NQK;
        int t = (int)(bt % T);
        act_t* x = qkv + bt * W + head * hd + 2 * p0;
        const float* f = freqs + ((long long)t * half + p0) * 2;
        if (vec) {
            pack_t v = load_pack(x);
#pragma unroll
            for (int k = 0; k < PACK / 2; k++) {
                float c = f[2 * k], s = sign * f[2 * k + 1];
                float x0 = to_f(v.v[2 * k]), x1 = to_f(v.v[2 * k + 1]);
                v.v[2 * k] = from_f(x0 * c - x1 * s);
                v.v[2 * k + 1] = from_f(x0 * s + x1 * c);
            }
            store_pack(x, v);
        } else {
            float c = f[0], s = sign * f[1];
            float x0 = to_f(x[0]), x1 = to_f(x[1]);
            x[0] = from_f(x0 * c - x1 * s);
            x[1] = from_f(x0 * s + x1 * c);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// encoder: out[b,t,:] = wte[inp[b,t],:] + wpe[t,:] (wpe null: no learned positions, Llama)
extern "C" __global__ void encoder_forward(act_t* out, const int* inp, const act_t* wte, const act_t* wpe,
                                           int N, int T, int C, int vec) {
    if (vec) {
        int cp = C / PACK;
        long long n = (long long)N * cp;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
            int row = (int)(i / cp), c = (int)(i % cp) * PACK;
            int tok = inp[row], t = row % T;
            pack_t a = load_pack(wte + (long long)tok * C + c), o;
            if (wpe != 0) {
                pack_t b = load_pack(wpe + (long long)t * C + c);
                #pragma unroll
                for (int k = 0; k < PACK; k++) o.v[k] = from_f(to_f(a.v[k]) + to_f(b.v[k]));
            } else {
                o = a;
            }
            store_pack(out + (long long)row * C + c, o);
        }
    } else {
        long long n = (long long)N * C;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
            int row = (int)(i / C), c = (int)(i % C);
            float p = wpe != 0 ? to_f(wpe[(long long)(row % T) * C + c]) : 0.0f;
            out[i] = wpe != 0 ? from_f(to_f(wte[(long long)inp[row] * C + c]) + p) : wte[(long long)inp[row] * C + c];
        }
    }
}

// dwte: positions sorted by token (stable, so within a token they are in position order). The block that owns
// the first position of a run sums the whole run in that order and adds it once: deterministic, no atomics.
extern "C" __global__ void encoder_backward_wte(act_t* dwte, const act_t* dout, const int* sorted_pos,
                                                const int* inp, int N, int C) {
    int i = blockIdx.x;
    int tok = inp[sorted_pos[i]];
    if (i > 0 && inp[sorted_pos[i - 1]] == tok) return;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = i; j < N; j++) {
            int pos = sorted_pos[j];
            if (inp[pos] != tok) break;
            acc += to_f(dout[(long long)pos * C + c]);
        }
        long long o = (long long)tok * C + c;
        dwte[o] = from_f(to_f(dwte[o]) + acc);
    }
}
// dwpe[t,c] += sum_b dout[b,t,c], b in order
extern "C" __global__ void encoder_backward_wpe(act_t* dwpe, const act_t* dout, int B, int T, int C) {
    long long n = (long long)T * C;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int b = 0; b < B; b++) acc += to_f(dout[(long long)b * n + i]);
        dwpe[i] = from_f(to_f(dwpe[i]) + acc);
    }
}

// ---------------------------------------------------------------------------------------------------------
// one warp's row of norm_forward (out8: its e4m3 copy scaled by s8, the amax of its act values into *m8)
__device__ __forceinline__ void norm_forward_row_scalar(act_t* out, float* mean, float* rstd, act_t* residual,
                                                        const act_t* inp1, const act_t* inp2, const act_t* weight,
                                                        const act_t* bias, int C, float eps, int rms, int row,
                                                        int lane, unsigned char* out8, float s8, unsigned int* m8) {
    const act_t* x = inp1 + (long long)row * C;
    if (residual != 0) {
        const act_t* y = inp2 + (long long)row * C;
        act_t* r = residual + (long long)row * C;
        for (int c = lane; c < C; c += 32) r[c] = from_f(to_f(x[c]) + to_f(y[c]));
        __syncwarp();
        x = r;
    }
    float m = 0.0f;
    if (!rms) {
        float s = 0.0f;
        for (int c = lane; c < C; c += 32) s += to_f(x[c]);
        m = warp_sum(s) / C;
    }
    float v = 0.0f;
    for (int c = lane; c < C; c += 32) { float d = to_f(x[c]) - m; v += d * d; }
    v = warp_sum(v) / C;
    float r = rsqrtf(v + eps);
    act_t* o = out + (long long)row * C;
    for (int c = lane; c < C; c += 32) {
        float n = (to_f(x[c]) - m) * r * to_f(weight[c]);
        if (!rms) n += to_f(bias[c]);
#ifdef ACT_BF16
        if (out8) {
            act_t a = from_f(n);
            *m8 = max(*m8, __float_as_uint(fabsf(to_f(a))));
            out8[(long long)row * C + c] = (unsigned char)fp8x2(to_f(a) * s8, 0.0f, 0);
            continue;
        }
#endif
        o[c] = from_f(n);
    }
    if (lane == 0) {
        if (!rms) mean[row] = m;
        rstd[row] = r;
    }
}
// layernorm / rmsnorm forward: one warp per row. With `residual`, the row is inp1 + inp2 (rounded to act and
// stored in residual) -- the fused residual + layernorm. rms != 0: rmsnorm (no mean, no bias). out8: the output
// in e4m3 there instead, as norm_forward_vec's (rows too wide for those: Llama 3.1 8B's C = 4096).
extern "C" __global__ void norm_forward(act_t* out, float* mean, float* rstd, act_t* residual, const act_t* inp1,
                                        const act_t* inp2, const act_t* weight, const act_t* bias, int N, int C,
                                        float eps, int rms, unsigned char* out8, float* inv8,
                                        const unsigned int* amax8, int hist_n, int stride, unsigned int* observe8) {
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
#ifdef ACT_BF16
    if (out8) {  // (every thread of the block reaches the amax's block reduction)
        float s8 = fp8_block_scale(inv8, amax8, hist_n, stride, 0);
        unsigned int m8 = 0;
        if (row < N) norm_forward_row_scalar(out, mean, rstd, residual, inp1, inp2, weight, bias, C, eps, rms, row,
                                             lane, out8, s8, &m8);
        fp8_observe(observe8, m8);
        return;
    }
#endif
    if (row < N) norm_forward_row_scalar(out, mean, rstd, residual, inp1, inp2, weight, bias, C, eps, rms, row, lane,
                                         0, 1.0f, 0);
}

// norm_forward's naive variant, for `llmc bench kernels --variants` (llm.c's dev/cuda layernorm_forward1): one
// thread per row, each row read three times with neighbouring threads a row apart (no coalescing). Same statistics,
// summed serially.
extern "C" __global__ void norm_forward_naive(act_t* out, float* mean, float* rstd, act_t* residual,
                                              const act_t* inp1, const act_t* inp2, const act_t* weight,
                                              const act_t* bias, int N, int C, float eps, int rms) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const act_t* x = inp1 + (long long)row * C;
    if (residual != 0) {
        const act_t* y = inp2 + (long long)row * C;
        act_t* r = residual + (long long)row * C;
        for (int c = 0; c < C; c++) r[c] = from_f(to_f(x[c]) + to_f(y[c]));
        x = r;
    }
    float m = 0.0f;
    if (!rms) {
        for (int c = 0; c < C; c++) m += to_f(x[c]);
        m /= C;
    }
    float v = 0.0f;
    for (int c = 0; c < C; c++) { float d = to_f(x[c]) - m; v += d * d; }
    float r = rsqrtf(v / C + eps);
    act_t* o = out + (long long)row * C;
    for (int c = 0; c < C; c++) {
        float n = (to_f(x[c]) - m) * r * to_f(weight[c]);
        if (!rms) n += to_f(bias[c]);
        o[c] = from_f(n);
    }
    if (!rms) mean[row] = m;
    rstd[row] = r;
}

// layernorm / rmsnorm backward, phase 1: one warp per row computes dinp (+=); the per-column partial sums of
// dweight / dbias of the rows a warp handled go to scratch[(block * warps + warp)][2][C] (no atomics).
extern "C" __global__ void norm_backward(act_t* dinp, float* scratch, const act_t* dout, const act_t* inp,
                                         const act_t* weight, const float* mean, const float* rstd, int N, int C,
                                         int rows_per_block, int rms) {
    extern __shared__ float sm[];  // [warps][2][C]
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* dw = sm + warp * 2 * C;
    float* db = dw + C;
    for (int c = lane; c < C; c += 32) { dw[c] = 0.0f; db[c] = 0.0f; }
    int r0 = blockIdx.x * rows_per_block;
    int r1 = min(N, r0 + rows_per_block);
    for (int row = r0 + warp; row < r1; row += warps) {
        const act_t* x = inp + (long long)row * C;
        const act_t* g = dout + (long long)row * C;
        float m = rms ? 0.0f : mean[row], r = rstd[row];
        float s1 = 0.0f, s2 = 0.0f;
        for (int c = lane; c < C; c += 32) {
            float xh = (to_f(x[c]) - m) * r;
            float dn = to_f(g[c]) * to_f(weight[c]);
            s1 += dn; s2 += dn * xh;
        }
        s1 = warp_sum(s1) / C; s2 = warp_sum(s2) / C;
        act_t* di = dinp + (long long)row * C;
        for (int c = lane; c < C; c += 32) {
            float xh = (to_f(x[c]) - m) * r;
            float gg = to_f(g[c]);
            float dn = gg * to_f(weight[c]);
            float d = rms ? (dn - xh * s2) * r : (dn - s1 - xh * s2) * r;
            di[c] = from_f(to_f(di[c]) + d);
            dw[c] += gg * xh;
            db[c] += gg;
        }
    }
    float* out = scratch + ((long long)blockIdx.x * warps + warp) * 2 * C;
    for (int c = lane; c < C; c += 32) { out[c] = dw[c]; out[C + c] = db[c]; }
}

// phase 2: dweight[c] += sum_p scratch[p][0][c]; dbias[c] += sum_p scratch[p][1][c] (p in order)
extern "C" __global__ void norm_backward_reduce(act_t* dweight, act_t* dbias, const float* scratch, int P, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float w = 0.0f, b = 0.0f;
    for (int p = 0; p < P; p++) { w += scratch[(long long)p * 2 * C + c]; b += scratch[(long long)p * 2 * C + C + c]; }
    dweight[c] = from_f(to_f(dweight[c]) + w);
    if (dbias != 0) dbias[c] = from_f(to_f(dbias[c]) + b);
}

// ---------------------------------------------------------------------------------------------------------
// Vectorised layernorm / rmsnorm (C % PACK == 0, 16-byte aligned rows, C <= 32 * P * PACK): each lane keeps its
// P packs of a row in registers, so every row is read once and written once with 128-bit accesses.
// Forward: one warp per row (same arithmetic as norm_forward: the residual is rounded to act before the stats).
// one warp's row of norm_forward_vec_impl (out8: its e4m3 copy scaled by s8, the amax of its bf16 values into *m8)
template <int P>
__device__ __forceinline__ void norm_forward_row(act_t* out, float* mean, float* rstd, act_t* residual,
                                                 const act_t* inp1, const act_t* inp2, const act_t* weight,
                                                 const act_t* bias, int N, int C, float eps, int rms,
                                                 unsigned char* out8, float s8, unsigned int* m8) {
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    int npk = C / PACK;
    long long base = (long long)row * C;
    float xf[P][PACK];
    #pragma unroll
    for (int k = 0; k < P; k++) {
        int pk = lane + 32 * k;
        if (pk < npk) {
            pack_t a = load_pack(inp1 + base + pk * PACK);
            if (residual != 0) {
                pack_t b = load_pack(inp2 + base + pk * PACK), r;
                #pragma unroll
                for (int j = 0; j < PACK; j++) r.v[j] = from_f(to_f(a.v[j]) + to_f(b.v[j]));
                store_pack(residual + base + pk * PACK, r);
                a = r;
            }
            #pragma unroll
            for (int j = 0; j < PACK; j++) xf[k][j] = to_f(a.v[j]);
        } else {
            #pragma unroll
            for (int j = 0; j < PACK; j++) xf[k][j] = 0.0f;
        }
    }
    float m = 0.0f;
    if (!rms) {
        float s = 0.0f;
        #pragma unroll
        for (int k = 0; k < P; k++) {
            #pragma unroll
            for (int j = 0; j < PACK; j++) s += xf[k][j];
        }
        m = warp_sum(s) / C;
    }
    float v = 0.0f;
    #pragma unroll
    for (int k = 0; k < P; k++) {
        if (lane + 32 * k < npk) {
            #pragma unroll
            for (int j = 0; j < PACK; j++) { float d = xf[k][j] - m; v += d * d; }
        }
    }
    v = warp_sum(v) / C;
    float r = rsqrtf(v + eps);
    #pragma unroll
    for (int k = 0; k < P; k++) {
        int pk = lane + 32 * k;
        if (pk < npk) {
            pack_t w = load_pack(weight + pk * PACK), b, o;
            if (!rms) b = load_pack(bias + pk * PACK);
            #pragma unroll
            for (int j = 0; j < PACK; j++) {
                float n = (xf[k][j] - m) * r * to_f(w.v[j]);
                if (!rms) n += to_f(b.v[j]);
                o.v[j] = from_f(n);
            }
#ifdef ACT_BF16
            if (out8) {
                *m8 = pack_amax(o, *m8);
                *reinterpret_cast<fp8x8_t*>(out8 + base + pk * PACK) = fp8_pack8(o, s8, 0);
                continue;
            }
#endif
            store_pack(out + base + pk * PACK, o);
        }
    }
    if (lane == 0) {
        if (!rms) mean[row] = m;
        rstd[row] = r;
    }
}

// With out8 (bf16 only), the output row goes to out8 in e4m3 instead of to `out`: a matmul's FP8 operand, scaled
// by the history at amax8 (fp8_block_scale), this call's amax recorded into observe8 (the FP8 section's producers).
template <int P>
__device__ __forceinline__ void norm_forward_vec_impl(act_t* out, float* mean, float* rstd, act_t* residual,
                                                      const act_t* inp1, const act_t* inp2, const act_t* weight,
                                                      const act_t* bias, int N, int C, float eps, int rms,
                                                      unsigned char* out8, float* inv8, const unsigned int* amax8,
                                                      int hist_n, int stride, unsigned int* observe8) {
#ifdef ACT_BF16
    if (out8) {  // (every thread of the block reaches the amax's block reduction)
        float s8 = fp8_block_scale(inv8, amax8, hist_n, stride, 0);
        unsigned int m8 = 0;
        norm_forward_row<P>(out, mean, rstd, residual, inp1, inp2, weight, bias, N, C, eps, rms, out8, s8, &m8);
        fp8_observe(observe8, m8);
        return;
    }
#endif
    norm_forward_row<P>(out, mean, rstd, residual, inp1, inp2, weight, bias, N, C, eps, rms, 0, 1.0f, 0);
}

// One pack of a row's backward once its two sums are known, shared by the warp-a-row and the grouped kernels below:
// dinp's pack (accumulated) and this lane's dweight / dbias columns.
template <bool RMS>
__device__ __forceinline__ void norm_bwd_apply(pack_t& d, const pack_t& x, const pack_t& g, const pack_t& w, float m,
                                               float r, float s1, float s2, float* dw, float* db) {
    #pragma unroll
    for (int j = 0; j < PACK; j++) {
        float xh = (to_f(x.v[j]) - m) * r;
        float gg = to_f(g.v[j]);
        float dn = gg * to_f(w.v[j]);
        float dd = RMS ? (dn - xh * s2) * r : (dn - s1 - xh * s2) * r;
        d.v[j] = from_f(to_f(d.v[j]) + dd);
        dw[j] += gg * xh;
        if (!RMS) db[j] += gg;
    }
}

// A lane's share of a row's two sums over the packs it holds (t, t + stride, ...): s1 += dn (not for rmsnorm) and
// s2 += dn * xhat, dn = dout * weight, in pack order (the row's sums add the lanes' after)
template <int P, bool RMS>
__device__ __forceinline__ void norm_bwd_sums(const pack_t (&xp)[P], const pack_t (&gp)[P], const pack_t (&w)[P],
                                              float m, float r, int t, int stride, int npk, float& s1, float& s2) {
    #pragma unroll
    for (int k = 0; k < P; k++) {
        if (t + stride * k < npk) {
            #pragma unroll
            for (int j = 0; j < PACK; j++) {
                float xh = (to_f(xp[k].v[j]) - m) * r;
                float dn = to_f(gp[k].v[j]) * to_f(w[k].v[j]);
                if (!RMS) s1 += dn;
                s2 += dn * xh;
            }
        }
    }
}

// The block's dweight / dbias: its `groups` row groups add their lanes' columns (lane t holds packs t, t + stride,
// ...) in group order into shared memory [2][C], and the block writes partial[b][2][C] (fixed order).
template <int P>
__device__ __forceinline__ void norm_bwd_partials(float* partial, float (&dw)[P][PACK], float (&db)[P][PACK],
                                                  int groups, int group, int t, int stride, int npk, int C,
                                                  bool no_bias) {
    extern __shared__ float sm[];
    float* sdw = sm;
    float* sdb = sm + C;
    for (int gi = 0; gi < groups; gi++) {
        if (group == gi) {
            #pragma unroll
            for (int k = 0; k < P; k++) {
                int pk = t + stride * k;
                if (pk < npk) {
                    #pragma unroll
                    for (int j = 0; j < PACK; j++) {
                        int c = pk * PACK + j;
                        if (gi == 0) { sdw[c] = dw[k][j]; sdb[c] = db[k][j]; }
                        else { sdw[c] += dw[k][j]; sdb[c] += db[k][j]; }
                    }
                }
            }
        }
        __syncthreads();
    }
    float* out = partial + (long long)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) { out[c] = sdw[c]; out[C + c] = no_bias ? 0.0f : sdb[c]; }
}

// Backward phase 1: block b owns rows [b*rows_per_block, ...), its warps take rows in turn; dinp += per row;
// each lane accumulates dweight / dbias of its columns in registers, the warps of a block add theirs in warp
// order in shared memory, and the block writes partial[b][2][C] (fixed order everywhere: deterministic).
template <int P, bool RMS>  // RMS: rmsnorm (no mean, no dbias: registers a P=8 lane would otherwise spill)
__device__ __forceinline__ void norm_backward_vec_impl(act_t* dinp, float* partial, const act_t* dout,
                                                       const act_t* inp, const act_t* weight, const float* mean,
                                                       const float* rstd, int N, int C, int rows_per_block) {
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int npk = C / PACK;
    float dw[P][PACK], db[P][PACK];
    pack_t w[P];
    #pragma unroll
    for (int k = 0; k < P; k++) {
        int pk = lane + 32 * k;
        if (pk < npk) w[k] = load_pack(weight + pk * PACK);
        #pragma unroll
        for (int j = 0; j < PACK; j++) { dw[k][j] = 0.0f; db[k][j] = 0.0f; }
    }
    int r0 = blockIdx.x * rows_per_block;
    int r1 = min(N, r0 + rows_per_block);
    for (int row = r0 + warp; row < r1; row += warps) {
        long long base = (long long)row * C;
        float m = RMS ? 0.0f : mean[row], r = rstd[row];
        pack_t xp[P], gp[P];
        #pragma unroll
        for (int k = 0; k < P; k++) {
            int pk = lane + 32 * k;
            if (pk < npk) { xp[k] = load_pack(inp + base + pk * PACK); gp[k] = load_pack(dout + base + pk * PACK); }
        }
        float s1 = 0.0f, s2 = 0.0f;
        norm_bwd_sums<P, RMS>(xp, gp, w, m, r, lane, 32, npk, s1, s2);
        s1 = warp_sum(s1) / C; s2 = warp_sum(s2) / C;
        #pragma unroll
        for (int k = 0; k < P; k++) {
            int pk = lane + 32 * k;
            if (pk < npk) {
                act_t* di = dinp + base + pk * PACK;
                pack_t dp = load_pack(di);
                norm_bwd_apply<RMS>(dp, xp[k], gp[k], w[k], m, r, s1, s2, dw[k], db[k]);
                store_pack(di, dp);
            }
        }
    }
    norm_bwd_partials<P>(partial, dw, db, warps, warp, lane, 32, npk, C, false);  // (rmsnorm: db stays 0)
}

#define NORM_VEC(P)                                                                                               \
extern "C" __global__ void norm_forward_vec##P(act_t* out, float* mean, float* rstd, act_t* residual,            \
        const act_t* inp1, const act_t* inp2, const act_t* weight, const act_t* bias, int N, int C, float eps,    \
        int rms, unsigned char* out8, float* inv8, const unsigned int* amax8, int hist_n, int stride,            \
        unsigned int* observe8) {                                                                                 \
    norm_forward_vec_impl<P>(out, mean, rstd, residual, inp1, inp2, weight, bias, N, C, eps, rms, out8, inv8,    \
                             amax8, hist_n, stride, observe8);                                                    \
}                                                                                                                 \
extern "C" __global__ void __launch_bounds__(256) norm_backward_vec##P(act_t* dinp, float* partial,              \
        const act_t* dout, const act_t* inp, const act_t* weight, const float* mean, const float* rstd, int N,   \
        int C, int rows_per_block) {                                                                              \
    norm_backward_vec_impl<P, false>(dinp, partial, dout, inp, weight, mean, rstd, N, C, rows_per_block);        \
}                                                                                                                 \
extern "C" __global__ void __launch_bounds__(256) norm_backward_rms_vec##P(act_t* dinp, float* partial,          \
        const act_t* dout, const act_t* inp, const act_t* weight, const float* mean, const float* rstd, int N,   \
        int C, int rows_per_block) {                                                                              \
    norm_backward_vec_impl<P, true>(dinp, partial, dout, inp, weight, mean, rstd, N, C, rows_per_block);         \
}
NORM_VEC(1)
NORM_VEC(2)
NORM_VEC(3)
NORM_VEC(4)
NORM_VEC(5)
NORM_VEC(6)
NORM_VEC(7)
NORM_VEC(8)

// Backward phase 1, grouped: G warps share a row (its 32*G lanes P packs each), so a lane holds few packs,
// registers stay low and many rows are in flight per SM (the one-warp-a-row kernel above keeps a whole row of
// C=2048 in a lane's registers: one block an SM, 0.9 TB/s). A row's two sums are added across its G warps in
// warp order through shared memory (double-buffered: one barrier a row); the block's groups then add their
// dweight / dbias columns in group order into partial[b][2][C]. Fixed order everywhere: deterministic.
template <int P, int G, bool RMS>
__device__ __forceinline__ void norm_backward_grp_impl(act_t* dinp, float* partial, const act_t* dout,
                                                       const act_t* inp, const act_t* weight, const float* mean,
                                                       const float* rstd, int N, int C, int rows_per_block) {
    __shared__ float red[2][32][2];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int groups = warps / G, group = warp / G, t = (warp % G) * 32 + lane;
    int npk = C / PACK;
    float dw[P][PACK], db[P][PACK];
    pack_t w[P];
    #pragma unroll
    for (int k = 0; k < P; k++) {
        int pk = t + 32 * G * k;
        if (pk < npk) w[k] = load_pack(weight + pk * PACK);
        #pragma unroll
        for (int j = 0; j < PACK; j++) { dw[k][j] = 0.0f; db[k][j] = 0.0f; }
    }
    int r0 = blockIdx.x * rows_per_block;
    int r1 = min(N, r0 + rows_per_block);
    int iters = (r1 - r0 + groups - 1) / groups;
    for (int it = 0; it < iters; it++) {
        int row = r0 + it * groups + group;
        bool active = row < r1 && group < groups;
        long long base = (long long)row * C;
        float m = 0.0f, r = 0.0f;
        pack_t xp[P], gp[P], dp[P];
        float s1 = 0.0f, s2 = 0.0f;
        if (active) {
            m = RMS ? 0.0f : mean[row]; r = rstd[row];
            #pragma unroll
            for (int k = 0; k < P; k++) {
                int pk = t + 32 * G * k;
                if (pk < npk) {
                    xp[k] = load_pack(inp + base + pk * PACK);
                    gp[k] = load_pack(dout + base + pk * PACK);
                    dp[k] = load_pack(dinp + base + pk * PACK);
                }
            }
            norm_bwd_sums<P, RMS>(xp, gp, w, m, r, t, 32 * G, npk, s1, s2);
        }
        s1 = warp_sum(s1); s2 = warp_sum(s2);
        if (lane == 0) { red[it & 1][warp][0] = s1; red[it & 1][warp][1] = s2; }
        __syncthreads();
        if (active) {
            s1 = 0.0f; s2 = 0.0f;
            #pragma unroll
            for (int i = 0; i < G; i++) { s1 += red[it & 1][group * G + i][0]; s2 += red[it & 1][group * G + i][1]; }
            s1 /= C; s2 /= C;
            #pragma unroll
            for (int k = 0; k < P; k++) {
                int pk = t + 32 * G * k;
                if (pk < npk) {
                    norm_bwd_apply<RMS>(dp[k], xp[k], gp[k], w[k], m, r, s1, s2, dw[k], db[k]);
                    store_pack(dinp + base + pk * PACK, dp[k]);
                }
            }
        }
    }
    norm_bwd_partials<P>(partial, dw, db, groups, group, t, 32 * G, npk, C, RMS);
}

#define NORM_GRP(P, G)                                                                                            \
extern "C" __global__ void __launch_bounds__(256) norm_backward_grp##P##_##G(act_t* dinp, float* partial, const act_t* dout,            \
        const act_t* inp, const act_t* weight, const float* mean, const float* rstd, int N, int C,               \
        int rows_per_block) {                                                                                     \
    norm_backward_grp_impl<P, G, false>(dinp, partial, dout, inp, weight, mean, rstd, N, C, rows_per_block);     \
}                                                                                                                 \
extern "C" __global__ void __launch_bounds__(256) norm_backward_rms_grp##P##_##G(act_t* dinp, float* partial, const act_t* dout,        \
        const act_t* inp, const act_t* weight, const float* mean, const float* rstd, int N, int C,               \
        int rows_per_block) {                                                                                     \
    norm_backward_grp_impl<P, G, true>(dinp, partial, dout, inp, weight, mean, rstd, N, C, rows_per_block);      \
}
NORM_GRP(1, 1)
NORM_GRP(2, 1)
NORM_GRP(1, 2)
NORM_GRP(2, 2)
NORM_GRP(1, 4)
NORM_GRP(2, 4)
NORM_GRP(1, 8)
NORM_GRP(2, 8)
NORM_GRP(3, 8)
NORM_GRP(4, 8)
NORM_GRP(5, 8)
NORM_GRP(6, 8)
NORM_GRP(7, 8)
NORM_GRP(8, 8)

// Backward phase 2: dweight[c] += sum_p partial[p][0][c], dbias likewise. 32 columns per block, its 8 warps
// take p = warp, warp+8, ... and warp 0 adds the 8 sums in order (fixed order: deterministic).
extern "C" __global__ void norm_backward_reduce_vec(act_t* dweight, act_t* dbias, const float* partial, int P,
                                                    int C) {
    __shared__ float sw[8][32], sb[8][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int c = blockIdx.x * 32 + lane;
    float w = 0.0f, b = 0.0f;
    if (c < C) {
        for (int p = warp; p < P; p += 8) {
            w += partial[(long long)p * 2 * C + c];
            b += partial[(long long)p * 2 * C + C + c];
        }
    }
    sw[warp][lane] = w; sb[warp][lane] = b;
    __syncthreads();
    if (warp == 0 && c < C) {
        float W = 0.0f, Bs = 0.0f;
        for (int i = 0; i < 8; i++) { W += sw[i][lane]; Bs += sb[i][lane]; }
        dweight[c] = from_f(to_f(dweight[c]) + W);
        if (dbias != 0) dbias[c] = from_f(to_f(dbias[c]) + Bs);
    }
}

// Matmul for a few rows (decoding: one token per sequence), where a tiled GEMM leaves most of the GPU idle and the
// cost is reading the weight once: out (N,OC) = inp (N,C) @ w(OC,C)^T [+ bias], one warp per output column reading
// its weight row in 16-byte packs, N <= GEMV_MAX_N rows at once, a fixed reduction order. With gelu, pre gets the
// pre-activation and out its GELU (the contract's pre_gelu). C a multiple of PACK, pointers 16-byte aligned.
#define GEMV_MAX_N 8
extern "C" __global__ void matmul_forward_gemv(act_t* out, act_t* pre, const act_t* inp, const act_t* w,
                                               const act_t* bias, int N, int C, int OC) {
    int o = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (o >= OC) return;
    float acc[GEMV_MAX_N];
#pragma unroll
    for (int n = 0; n < GEMV_MAX_N; n++) acc[n] = 0.0f;
    const act_t* wr = w + (long long)o * C;
    for (int c = lane * PACK; c < C; c += 32 * PACK) {
        pack_t wp = load_pack(wr + c);
#pragma unroll
        for (int n = 0; n < GEMV_MAX_N; n++) {
            if (n < N) {
                pack_t xp = load_pack(inp + (long long)n * C + c);
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < PACK; i++) s += to_f(wp.v[i]) * to_f(xp.v[i]);
                acc[n] += s;
            }
        }
    }
#pragma unroll
    for (int n = 0; n < GEMV_MAX_N; n++) {
        if (n < N) {
            float v = warp_sum(acc[n]);
            if (lane == 0) {
                if (bias) v += to_f(bias[o]);
                long long i = (long long)n * OC + o;
                if (pre) {
                    pre[i] = from_f(v);
                    out[i] = from_f(gelu_f(v));
                } else {
                    out[i] = from_f(v);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// bias: out (N,OC) += bias; column sums for dbias (two phases, fixed order)
extern "C" __global__ void add_bias(act_t* out, const act_t* bias, long long N, int OC) {
    long long n = N * OC;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = from_f(to_f(out[i]) + to_f(bias[i % OC]));
}
// scratch[blockIdx.y][c] = sum over rows [y*rows_per, (y+1)*rows_per) of dout[row, c]
extern "C" __global__ void column_sums(float* scratch, const act_t* dout, int N, int OC, int rows_per) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    int r0 = blockIdx.y * rows_per, r1 = min(N, r0 + rows_per);
    float acc = 0.0f;
    for (int r = r0; r < r1; r++) acc += to_f(dout[(long long)r * OC + c]);
    scratch[(long long)blockIdx.y * OC + c] = acc;
}
extern "C" __global__ void column_sums_reduce(act_t* dbias, const float* scratch, int P, int OC) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= OC) return;
    float acc = 0.0f;
    for (int p = 0; p < P; p++) acc += scratch[(long long)p * OC + c];
    dbias[c] = from_f(to_f(dbias[c]) + acc);
}
// dbias += tmp (cuBLASLt's BGRADB result, in act dtype)
extern "C" __global__ void accumulate_act(act_t* dst, const act_t* src, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = from_f(to_f(dst[i]) + to_f(src[i]));
}

// ---------------------------------------------------------------------------------------------------------
// FP8 (--dtype fp8): the per-tensor scaled casts in front of cuBLASLt's FP8 matmuls. e4m3 (largest finite 448)
// for weights and activations, e5m2 (57344) for gradients. Every block of a cast derives scale = largest finite /
// amax itself (no host sync, no extra launch) and block 0 writes the inverse the matmul dequantizes with. The amax
// is the largest of `hist_n` words `stride` apart: this call's own amax (current scaling: fp8_amax first, n = 1)
// or a tensor's history of earlier steps (delayed scaling: no pass before the cast; the cast itself records this
// call's amax into `observe` for fp8_roll). amax is a max over the float's bits (|x| >= 0 orders like its bits,
// NaN above infinity): order-free, so deterministic, and a NaN or infinity reaches the loss instead of vanishing.
// Producers: under delayed scaling the scale is known before a tensor exists, so the norms, SwiGLU and GELU write
// the operand of the matmul that reads their output next in FP8 themselves, in place of their bf16 output (the
// engine's fp8_next), the same bytes a cast of that output would write; fp8_transpose gives the backward's
// products their transposed copies of those.
#ifdef ACT_BF16
// amax |= max |x| over n elements (n % 8 == 0, 16-byte aligned); amax zeroed by the caller
extern "C" __global__ void fp8_amax(unsigned int* amax, const act_t* x, long long n) {
    unsigned int m = 0;
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 8; i < n;
         i += (long long)gridDim.x * blockDim.x * 8)
        m = pack_amax(load_pack(x + i), m);
    fp8_observe(amax, m);
}
// out (n bytes) = fp8(x * scale); inv_scale[0] = 1 / scale; *observe |= amax of x (when not null)
extern "C" __global__ void fp8_quantize(unsigned char* out, float* inv_scale, const unsigned int* amax,
                                        int hist_n, int stride, unsigned int* observe, const act_t* x, long long n,
                                        int e5m2) {
    float s = fp8_block_scale(inv_scale, amax, hist_n, stride, e5m2);
    unsigned int m = 0;
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 8; i < n;
         i += (long long)gridDim.x * blockDim.x * 8) {
        pack_t p = load_pack(x + i);
        if (observe) m = pack_amax(p, m);
        *reinterpret_cast<fp8x8_t*>(out + i) = fp8_pack8(p, s, e5m2);
    }
    if (observe) fp8_observe(observe, m);
}
// x (rows, cols) -> out (rows, cols) and/or out_t (cols, rows), through a 64x64 tile in shared memory (either may
// be null); rows % 8 == 0, cols % 8 == 0. One block per tile, 256 threads (8 elements per access: a thread's two
// packs are rows r and r + 32 of the same 8 columns). With colsum (the gradient's bias sums, GPT-2), each tile's
// column sums of x in float32 go to colsum[tile row][col], summed in a fixed order (column_sums_reduce after).
#define FP8_TILE 64
// a 64x64 tile of FP8 bytes (tile[r][c] = element (r0 + r, c0 + c)) written transposed into out_t (cols, rows)
__device__ __forceinline__ void fp8_tile_store_t(unsigned char* out_t, const unsigned char (*tile)[FP8_TILE + 8],
                                                 int r0, int c0, int rows, int cols) {
    for (int i = threadIdx.x; i < FP8_TILE * FP8_TILE / 8; i += blockDim.x) {
        int c = i / (FP8_TILE / 8), r = (i % (FP8_TILE / 8)) * 8;
        if (c0 + c < cols && r0 + r < rows) {
            fp8x8_t q;
            q.x = tile[r][c] | (tile[r + 1][c] << 8) | (tile[r + 2][c] << 16) | ((unsigned int)tile[r + 3][c] << 24);
            q.y = tile[r + 4][c] | (tile[r + 5][c] << 8) | (tile[r + 6][c] << 16) | ((unsigned int)tile[r + 7][c] << 24);
            *reinterpret_cast<fp8x8_t*>(out_t + (long long)(c0 + c) * rows + r0 + r) = q;
        }
    }
}
extern "C" __global__ void __launch_bounds__(256) fp8_quantize_t(unsigned char* out, unsigned char* out_t,
        float* inv_scale, const unsigned int* amax, int hist_n, int stride, unsigned int* observe, const act_t* x,
        int rows, int cols, int e5m2, float* colsum) {
    __shared__ __align__(8) unsigned char tile[FP8_TILE][FP8_TILE + 8];
    __shared__ float csum[FP8_TILE / 2][FP8_TILE + 1];
    float s = fp8_block_scale(inv_scale, amax, hist_n, stride, e5m2);
    int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    unsigned int m = 0;
    float sums[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int i = threadIdx.x; i < FP8_TILE * FP8_TILE / 8; i += blockDim.x) {
        int r = i / (FP8_TILE / 8), c = (i % (FP8_TILE / 8)) * 8;
        fp8x8_t q = {0u, 0u};
        if (r0 + r < rows && c0 + c < cols) {
            long long at = (long long)(r0 + r) * cols + c0 + c;
            pack_t p = load_pack(x + at);
            if (observe) m = pack_amax(p, m);
            if (colsum) {
#pragma unroll
                for (int j = 0; j < 8; j++) sums[j] += to_f(p.v[j]);
            }
            q = fp8_pack8(p, s, e5m2);
            if (out) *reinterpret_cast<fp8x8_t*>(out + at) = q;
        }
        *reinterpret_cast<fp8x8_t*>(&tile[r][c]) = q;
    }
    if (observe) fp8_observe(observe, m);
    if (colsum) {
        int r = threadIdx.x / (FP8_TILE / 8), c = (threadIdx.x % (FP8_TILE / 8)) * 8;
#pragma unroll
        for (int j = 0; j < 8; j++) csum[r][c + j] = sums[j];
        __syncthreads();
        if (threadIdx.x < FP8_TILE && c0 + threadIdx.x < cols) {
            float acc = 0.0f;
            for (int k = 0; k < FP8_TILE / 2; k++) acc += csum[k][threadIdx.x];
            colsum[(long long)blockIdx.y * cols + c0 + threadIdx.x] = acc;
        }
    }
    if (!out_t) return;
    __syncthreads();
    fp8_tile_store_t(out_t, tile, r0, c0, rows, cols);
}
// out_t (cols, rows) = the FP8 bytes in (rows, cols), transposed: where a producer wrote a matmul's operand (the
// rows) and the backward's product takes it transposed (rows % 8 == 0, cols % 8 == 0; 64x64 tiles as above)
extern "C" __global__ void __launch_bounds__(256) fp8_transpose(unsigned char* out_t, const unsigned char* in,
                                                                 int rows, int cols) {
    __shared__ __align__(8) unsigned char tile[FP8_TILE][FP8_TILE + 8];
    int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    for (int i = threadIdx.x; i < FP8_TILE * FP8_TILE / 8; i += blockDim.x) {
        int r = i / (FP8_TILE / 8), c = (i % (FP8_TILE / 8)) * 8;
        fp8x8_t q = {0u, 0u};
        if (r0 + r < rows && c0 + c < cols)
            q = *reinterpret_cast<const fp8x8_t*>(in + (long long)(r0 + r) * cols + c0 + c);
        *reinterpret_cast<fp8x8_t*>(&tile[r][c]) = q;
    }
    __syncthreads();
    fp8_tile_store_t(out_t, tile, r0, c0, rows, cols);
}
// SwiGLU as FP8 producers (vec layout only: H % 8 == 0, 16-byte aligned): the forward's output in e4m3 for the down
// projection, the backward's [dgate | dup] in e5m2 for the gate/up projection's backward, each scaled by the
// history at amax (fp8_block_scale) with this call's amax into observe; the values are swiglu_forward's and
// swiglu_backward's bf16 ones, so the bytes are what the cast of those would write
// both walk the N x H outputs a pack at a time over the grid; pack(r, h, m) writes one and returns the amax so far
template <typename Pack>
__device__ __forceinline__ void swiglu_fp8_walk(unsigned int* observe, long long N, int H, Pack pack) {
    unsigned int m = 0;
    int hp = H / PACK;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < N * hp;
         i += (long long)gridDim.x * blockDim.x) {
        long long r = i / hp;
        m = pack(r, (int)(i - r * hp) * PACK, m);
    }
    fp8_observe(observe, m);
}
extern "C" __global__ void swiglu_forward_fp8(unsigned char* out8, float* inv8, const unsigned int* amax, int hist_n,
                                              int stride, unsigned int* observe, const act_t* inp, long long N,
                                              int H) {
    float s = fp8_block_scale(inv8, amax, hist_n, stride, 0);
    swiglu_fp8_walk(observe, N, H, [&](long long r, int h, unsigned int m) {
        pack_t o = swiglu_pack(load_pack(inp + r * 2 * H + h), load_pack(inp + r * 2 * H + H + h));
        *reinterpret_cast<fp8x8_t*>(out8 + r * H + h) = fp8_pack8(o, s, 0);
        return pack_amax(o, m);
    });
}
extern "C" __global__ void swiglu_backward_fp8(unsigned char* dinp8, float* inv8, const unsigned int* amax, int hist_n,
                                               int stride, unsigned int* observe, const act_t* dout, const act_t* inp,
                                               long long N, int H) {
    float s = fp8_block_scale(inv8, amax, hist_n, stride, 1);
    swiglu_fp8_walk(observe, N, H, [&](long long r, int h, unsigned int m) {
        pack_t dg, du;
        swiglu_grad_packs(dout, inp, r, h, H, dg, du);
        *reinterpret_cast<fp8x8_t*>(dinp8 + r * 2 * H + h) = fp8_pack8(dg, s, 1);
        *reinterpret_cast<fp8x8_t*>(dinp8 + r * 2 * H + H + h) = fp8_pack8(du, s, 1);
        return pack_amax(du, pack_amax(dg, m));
    });
}
// GELU as an FP8 producer (GPT-2's MLP: the output projection's e4m3 input), from the pre-activation (n % 8 == 0,
// 16-byte aligned), scaled and observed as swiglu_forward_fp8; the values are gelu_forward's bf16 ones
extern "C" __global__ void gelu_forward_fp8(unsigned char* out8, float* inv8, const unsigned int* amax, int hist_n,
                                            int stride, unsigned int* observe, const act_t* inp, long long n) {
    float s = fp8_block_scale(inv8, amax, hist_n, stride, 0);
    unsigned int m = 0;
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * PACK; i < n;
         i += (long long)gridDim.x * blockDim.x * PACK) {
        pack_t o = gelu_pack(load_pack(inp + i));
        m = pack_amax(o, m);
        *reinterpret_cast<fp8x8_t*>(out8 + i) = fp8_pack8(o, s, 0);
    }
    fp8_observe(observe, m);
}
// out (n act) = the values of the FP8 bytes `in` (e4m3, or e5m2) times inv_scale[0]: a producer's operand made act
// again for a product that runs in bf16 after all (n % 8 == 0, 16-byte aligned)
extern "C" __global__ void fp8_dequantize(act_t* out, const unsigned char* in, const float* inv_scale, long long n,
                                          int e5m2) {
    float inv = inv_scale[0];
    for (long long i = (blockIdx.x * (long long)blockDim.x + threadIdx.x) * 8; i < n;
         i += (long long)gridDim.x * blockDim.x * 8) {
        fp8x8_t q = *reinterpret_cast<const fp8x8_t*>(in + i);
        unsigned int words[2] = {q.x, q.y};
        pack_t o;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            unsigned short pair = (unsigned short)(words[j / 2] >> (16 * (j % 2))), lo, hi;
            unsigned int h2 = 0;
#if LLMC_CC >= 89
            if (e5m2) asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(pair));
            else asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
#endif
            lo = (unsigned short)(h2 & 0xffffu);
            hi = (unsigned short)(h2 >> 16);
            float a, b;
            asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(lo));
            asm("cvt.f32.f16 %0, %1;" : "=f"(b) : "h"(hi));
            o.v[2 * j] = from_f(a * inv);
            o.v[2 * j + 1] = from_f(b * inv);
        }
        store_pack(out + i, o);
    }
}
// delayed scaling, once a step: each of `sites` histories (hist[k * sites + site], k = 1..hist_n; k = 0 is the
// step's amax so far) moves one step older and takes the step's amax, which restarts at zero. A non-finite amax
// is not kept: that step's update was skipped (step_guard), and it must not spoil the next hist_n steps' scales.
extern "C" __global__ void fp8_roll(unsigned int* hist, int sites, int hist_n) {
    int site = blockIdx.x * blockDim.x + threadIdx.x;
    if (site >= sites) return;
    for (int k = hist_n; k > 1; k--) hist[(long long)k * sites + site] = hist[(long long)(k - 1) * sites + site];
    unsigned int now = hist[site];
    hist[sites + site] = now < 0x7f800000u ? now : 0u;
    hist[site] = 0u;
}
#endif

// ---------------------------------------------------------------------------------------------------------
// fused classifier: one block per row. losses[row] = lse - logit[target]; with dloss != 0 (has_d), logits are
// overwritten by (softmax - onehot) * dloss, zero in the padded columns. Logits stay in act dtype.
// Pass 1 of a row: its max bm and 1 / (sum of exp(logit - bm)) by online max / sum (a -inf logit adds nothing:
// while m is still -inf, exp(v - m) would be exp(NaN); a NaN logit still makes the row's loss NaN), fixed tree;
// returns the row's log-sum-exp.
__device__ float classifier_row_lse(const act_t* x, int V, int vec, float* red, float& bm, float& inv) {
    int tid = threadIdx.x, nt = blockDim.x, lane = tid % 32, warp = tid / 32, nw = nt / 32;
    float m = -LLMC_INF, s = 0.0f;
    int Vv = vec ? (V / PACK) * PACK : 0;
    for (int i = tid * PACK; i < Vv; i += nt * PACK) {
        pack_t p = load_pack(x + i);
        #pragma unroll
        for (int k = 0; k < PACK; k++) {
            float v = to_f(p.v[k]);
            if (v > m) { s = s * expf(m - v) + 1.0f; m = v; } else if (v != -LLMC_INF) { s += expf(v - m); }
        }
    }
    for (int i = Vv + tid; i < V; i += nt) {
        float v = to_f(x[i]);
        if (v > m) { s = s * expf(m - v) + 1.0f; m = v; } else if (v != -LLMC_INF) { s += expf(v - m); }
    }
    float wm = warp_max(m);
    s = (m == -LLMC_INF) ? 0.0f : s * expf(m - wm);
    s = warp_sum(s);
    if (lane == 0) { red[warp] = wm; }
    __syncthreads();
    bm = -LLMC_INF;
    for (int w = 0; w < nw; w++) bm = fmaxf(bm, red[w]);
    __syncthreads();
    if (lane == 0) red[warp] = (wm == -LLMC_INF) ? 0.0f : s * expf(wm - bm);
    __syncthreads();
    float bs = 0.0f;
    for (int w = 0; w < nw; w++) bs += red[w];
    inv = 1.0f / bs;
    return bm + logf(bs);
}
// one dlogit: (softmax - onehot) * dloss, rounded to act
__device__ __forceinline__ act_t classifier_dlogit(float v, float bm, float inv, bool hit, float dloss) {
    return from_f((expf(v - bm) * inv - (hit ? 1.0f : 0.0f)) * dloss);
}
extern "C" __global__ void classifier_fwd_bwd(act_t* logits, float* losses, const int* targets, int N, int V, int Vp,
                                              float dloss, int has_d, int vec) {
    __shared__ float red[32];
    int row = blockIdx.x;
    act_t* x = logits + (long long)row * Vp;
    int tid = threadIdx.x, nt = blockDim.x;
    float bm, inv;
    float lse = classifier_row_lse(x, V, vec, red, bm, inv);
    int tgt = targets[row];
    bool bad = tgt < 0 || tgt >= V;
    if (tid == 0) losses[row] = bad ? LLMC_NAN : lse - to_f(x[tgt]);
    if (!has_d) return;
    __syncthreads();  // everyone read x[tgt] (thread 0) before it is overwritten
    int Vv = vec ? (V / PACK) * PACK : 0;
    for (int i = tid * PACK; i < Vv; i += nt * PACK) {
        pack_t p = load_pack(x + i);
        #pragma unroll
        for (int k = 0; k < PACK; k++) p.v[k] = classifier_dlogit(to_f(p.v[k]), bm, inv, i + k == tgt, dloss);
        store_pack(x + i, p);
    }
    for (int i = Vv + tid; i < V; i += nt) x[i] = classifier_dlogit(to_f(x[i]), bm, inv, i == tgt, dloss);
    for (int i = V + tid; i < Vp; i += nt) x[i] = from_f(0.0f);
}
#ifdef ACT_BF16
// the fused classifier as the FP8 producer of the classifier's backward (vec layout: Vp % 8 == 0, 16-byte
// aligned): the dlogits classifier_fwd_bwd would write, in e5m2 into out8 (N x Vp) rather than over the logits,
// which other rows' blocks still read; scaled by the history at amax (fp8_block_scale), this call's amax into
// observe, so the bytes are what the cast of those dlogits would write
extern "C" __global__ void classifier_fwd_bwd_fp8(const act_t* logits, float* losses, const int* targets, int N,
                                                  int V, int Vp, float dloss, unsigned char* out8, float* inv8,
                                                  const unsigned int* amax, int hist_n, int stride,
                                                  unsigned int* observe) {
    __shared__ float red[32];
    int row = blockIdx.x;
    const act_t* x = logits + (long long)row * Vp;
    unsigned char* o = out8 + (long long)row * Vp;
    int tid = threadIdx.x, nt = blockDim.x;
    float bm, inv;
    float lse = classifier_row_lse(x, V, 1, red, bm, inv);
    int tgt = targets[row];
    if (tid == 0) losses[row] = (tgt < 0 || tgt >= V) ? LLMC_NAN : lse - to_f(x[tgt]);
    float s = fp8_block_scale(inv8, amax, hist_n, stride, 1);
    unsigned int m = 0;
    int Vv = (V / PACK) * PACK;
    for (int i = tid * PACK; i < Vv; i += nt * PACK) {
        pack_t p = load_pack(x + i);
        #pragma unroll
        for (int k = 0; k < PACK; k++) p.v[k] = classifier_dlogit(to_f(p.v[k]), bm, inv, i + k == tgt, dloss);
        m = pack_amax(p, m);
        *reinterpret_cast<fp8x8_t*>(o + i) = fp8_pack8(p, s, 1);
    }
    for (int i = Vv + tid; i < Vp; i += nt) {  // (the last logits of a vocabulary not a multiple of 8; the padding)
        float v = i < V ? to_f(classifier_dlogit(to_f(x[i]), bm, inv, i == tgt, dloss)) : 0.0f;
        m = max(m, __float_as_uint(fabsf(v)));
        o[i] = (unsigned char)(fp8x2(v * s, 0.0f, 1) & 0xffu);
    }
    fp8_observe(observe, m);
}
#endif

// ---------------------------------------------------------------------------------------------------------
// global norm: phase 1 per tensor, each block writes its partial sum of squares (fixed grid, fixed tree);
// phase 2 sums all partials in order in double.
extern "C" __global__ void sumsq_partial(float* partials, const act_t* g, long long n) {
    __shared__ float red[32];
    float acc = 0.0f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float v = to_f(g[i]); acc += v * v;
    }
    acc = warp_sum(acc);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < blockDim.x / 32; w++) s += red[w];
        partials[blockIdx.x] = s;
    }
}
extern "C" __global__ void sumsq_final(float* out, const float* partials, int P) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0.0;
    for (int p = 0; p < P; p++) s += (double)partials[p];
    out[0] = (float)s;
}

// the step's mean loss on the device: out = w * sum(losses) (+ out), one block, float64 in a fixed order
extern "C" __global__ void loss_sum(float* out, const float* losses, long long n, double w, int accumulate) {
    __shared__ double red[1024];
    double acc = 0.0;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) acc += (double)losses[i];
    red[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {  // blockDim.x is a power of two
        if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        double t = w * red[0];
        if (accumulate) t += (double)out[0];
        out[0] = (float)t;
    }
}
__device__ __forceinline__ bool finite_f(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }
// guard = [loss, norm, clip scale, apply]: what AdamW needs, without the host reading loss and norm first
extern "C" __global__ void step_guard(float* guard, const float* loss, const float* norm_squared, double clip,
                                      float max_loss, float max_norm) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    float l = loss[0];
    double norm = sqrt((double)norm_squared[0]);
    float n = (float)norm;
    double scale = (clip > 0.0 && norm > clip) ? clip / norm : 1.0;
    bool ok = finite_f(l) && finite_f(n) && !(l > max_loss) && !(n > max_norm);
    guard[0] = l; guard[1] = n; guard[2] = (float)scale; guard[3] = ok ? 1.0f : 0.0f;
}

// ---------------------------------------------------------------------------------------------------------
// The cuBLASLt tuner's bit signature of an output (cublaslt.py): two 64-bit sums over its 16- or 32-bit words,
// added into sig[0], sig[1]. Integer atomics are exact, so the order of the additions (and the grid) cannot change
// the result.
// splitmix64's finalizer: every bit of z reaches every bit of the result
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
extern "C" __global__ void bits_signature(unsigned long long* sig, const void* p, long long n, int wide) {
    // independent 64-bit hashes of (place, word): any change of a word, two words trading places included, alters
    // the sums but by a 2^-64 chance (sums of the words and of their squares would miss two roundings that swap
    // neighbouring values, and a candidate with other bits would then join the race)
    unsigned long long s = 0, q = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned long long x = wide ? ((const unsigned int*)p)[i] : ((const unsigned short*)p)[i];
        s += mix64((unsigned long long)i * 0x9e3779b97f4a7c15ULL + x);
        q += mix64(mix64((unsigned long long)i ^ 0xd1b54a32d192ed03ULL) ^ (x * 0xff51afd7ed558ccdULL));
    }
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        q += __shfl_xor_sync(0xffffffffu, q, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(sig, s);
        atomicAdd(sig + 1, q);
    }
}

// ---------------------------------------------------------------------------------------------------------
// AdamW (same operation order as the CPU backend / torch.optim.AdamW). master != 0: update the fp32 master and
// write param = stochastic_round_bf16(master), seeded by (seed, index).
__device__ __forceinline__ unsigned int hash_u32(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}
__device__ __forceinline__ act_t stochastic_round(float f, unsigned int rnd) {
#ifdef ACT_BF16
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7f800000u) == 0x7f800000u) return from_f(f);  // inf / NaN: no noise
    u += (rnd & 0xffffu);
    return (act_t)(u >> 16);
#else
    return f;
#endif
}
// one element's update (the scalar and the packed loops share it, so both give the same bits)
__device__ __forceinline__ float adamw_value(float p, float g, float& mi, float& vi, float beta1, float beta2, float eps,
                                             float decay, int has_decay, float c1, float c2, float step_size,
                                             float rbc2) {
    // every rounding spelled out: "a * b + c * d" lets the compiler fuse either product into an FMA, and it may
    // choose differently in the packed loop than in the scalar one (float32's params showed other bits)
    if (has_decay) p = __fmul_rn(p, decay);
    mi = __fmaf_rn(mi, beta1, __fmul_rn(g, c1));
    vi = __fmaf_rn(vi, beta2, __fmul_rn(__fmul_rn(g, g), c2));
    float den = __fmaf_rn(sqrtf(vi), rbc2, eps);
    return __fmaf_rn(-__fdiv_rn(mi, den), step_size, p);
}
__device__ __forceinline__ act_t adamw_out(float p, long long i, unsigned int seed, int has_master) {
    if (!has_master) return from_f(p);
    return stochastic_round(p, hash_u32(seed ^ hash_u32((unsigned int)i ^ (unsigned int)(i >> 32) * 0x9e3779b9u)));
}
// four elements a thread: float4 for m, v and master, four act_t (8 or 16 bytes) for grad, param and the mirrors
struct __align__(4 * sizeof(act_t)) act4_t { act_t v[4]; };
// vec != 0: n % 4 == 0, m, v and master 16-byte aligned, param and grad aligned to 4 elements (the mirrors, at the
// same offsets of allocations laid out alike, with them)
extern "C" __global__ void adamw_kernel(act_t* param, const act_t* grad, float* m, float* v, float* master,
                                        long long n, float lr, float beta1, float beta2, float eps, float decay,
                                        int has_decay, float c1, float c2, float step_size, float rbc2,
                                        unsigned int seed, const float* guard, double omb1, double omb2,
                                        const unsigned long long* mirrors, int n_mirrors, int vec) {
    if (guard != 0) {  // scale and verdict from step_guard, read when the update runs
        if (guard[3] == 0.0f) return;
        double s = (double)guard[2];
        c1 = (float)(omb1 * s);
        c2 = (float)(omb2 * s * s);
    }
    const long long stride = (long long)gridDim.x * blockDim.x;
    const int has_master = master != 0;
    if (vec) {
        for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < n / 4; j += stride) {
            float4 m4 = reinterpret_cast<float4*>(m)[j], v4 = reinterpret_cast<float4*>(v)[j];
            act4_t g4 = reinterpret_cast<const act4_t*>(grad)[j], o;
            float p4[4];
            if (has_master) {
                float4 w = reinterpret_cast<float4*>(master)[j];
                p4[0] = w.x; p4[1] = w.y; p4[2] = w.z; p4[3] = w.w;
            } else {
                act4_t w = reinterpret_cast<act4_t*>(param)[j];
                for (int k = 0; k < 4; k++) p4[k] = to_f(w.v[k]);
            }
            float* mk = reinterpret_cast<float*>(&m4);
            float* vk = reinterpret_cast<float*>(&v4);
#pragma unroll
            for (int k = 0; k < 4; k++) {
                p4[k] = adamw_value(p4[k], to_f(g4.v[k]), mk[k], vk[k], beta1, beta2, eps, decay, has_decay, c1, c2,
                                    step_size, rbc2);
                o.v[k] = adamw_out(p4[k], j * 4 + k, seed, has_master);
            }
            reinterpret_cast<float4*>(m)[j] = m4;
            reinterpret_cast<float4*>(v)[j] = v4;
            if (has_master) reinterpret_cast<float4*>(master)[j] = make_float4(p4[0], p4[1], p4[2], p4[3]);
            reinterpret_cast<act4_t*>(param)[j] = o;
            // data parallel over peer memory (p2p.py): the other ranks' copies of this chunk, written here in place
            // of an all-gather after the update
            for (int d = 0; d < n_mirrors; d++) reinterpret_cast<act4_t*>((act_t*)mirrors[d])[j] = o;
        }
    } else {
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
            float mi = m[i], vi = v[i];
            float p = adamw_value(has_master ? master[i] : to_f(param[i]), to_f(grad[i]), mi, vi, beta1, beta2, eps,
                                  decay, has_decay, c1, c2, step_size, rbc2);
            m[i] = mi; v[i] = vi;
            if (has_master) master[i] = p;
            act_t out = adamw_out(p, i, seed, has_master);
            param[i] = out;
            for (int d = 0; d < n_mirrors; d++) ((act_t*)mirrors[d])[i] = out;
        }
    }
    if (n_mirrors) __threadfence_system();
}

// data parallel over peer memory (p2p.py, --backend-opt p2p_reduce=on): out[i] = the mean over the ranks' copies
// (srcs, one pointer a rank, in rank order) of element off + i, summed in rank order in float32 and divided once (for
// two ranks the bits of NCCL's bf16 / float32 average); loads bypass the caches, since the peers wrote these buffers
// since the last kernel
__device__ __forceinline__ pack_t load_pack_cv(const act_t* p) {
    union { uint4 u; pack_t x; } c;
    c.u = __ldcv(reinterpret_cast<const uint4*>(p));
    return c.x;
}
extern "C" __global__ void peer_mean(act_t* out, const unsigned long long* srcs, int nsrc, long long off, long long n,
                                     int vec) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long i0 = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    float w = (float)nsrc;
    if (vec) {
        for (long long i = i0 * PACK; i < n; i += stride * PACK) {
            float acc[PACK];
            pack_t x = load_pack_cv((const act_t*)srcs[0] + off + i), o;
            #pragma unroll
            for (int j = 0; j < PACK; j++) acc[j] = to_f(x.v[j]);
            for (int k = 1; k < nsrc; k++) {
                x = load_pack_cv((const act_t*)srcs[k] + off + i);
                #pragma unroll
                for (int j = 0; j < PACK; j++) acc[j] += to_f(x.v[j]);
            }
            #pragma unroll
            for (int j = 0; j < PACK; j++) o.v[j] = from_f(__fdiv_rn(acc[j], w));
            store_pack(out + i, o);
        }
    } else {
        for (long long i = i0; i < n; i += stride) {
            float acc = to_f(__ldcv((const act_t*)srcs[0] + off + i));
            for (int k = 1; k < nsrc; k++) acc += to_f(__ldcv((const act_t*)srcs[k] + off + i));
            out[i] = from_f(__fdiv_rn(acc, w));
        }
    }
}

// ---------------------------------------------------------------------------------------------------------
// The next token drawn where the logits are (Backend.sample_token), by inference.sampling.choose_token's rule with
// top_k 0 and top_p 1: greedy, the first largest id; else the first id whose running sum of exp(x/T - max) exceeds
// u times the whole sum, in float64 as on the host (the same id for the same u, but where u lies within rounding
// of a boundary). One block; warp w owns ids [w*span, (w+1)*span), its lanes reading them 32 at a time. out = [id,
// bad]: bad counts NaN and +inf logits (V when all are -inf), for the host's error.
#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_token(int* out, const act_t* logits, int V,
                                                                          double u, double temperature) {
    __shared__ float wmax[SAMPLE_WARPS];
    __shared__ int warg[SAMPLE_WARPS], wbad[SAMPLE_WARPS];
    __shared__ double wsum[SAMPLE_WARPS];
    __shared__ double base_s, target_s;
    __shared__ int who_s;
    const unsigned all = 0xffffffffu;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int span = ((V + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) & ~31;
    int lo = min(w * span, V), hi = min(lo + span, V);
    float m = -LLMC_INF;
    int arg = -1, bad = 0;
    for (int i = lo + lane; i < hi; i += 32) {
        float x = to_f(logits[i]);
        if (x != x || x == LLMC_INF) bad++;
        else if (x > m) { m = x; arg = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {  // the warp's largest (the first id on ties; -1: nothing above -inf)
        float m2 = __shfl_xor_sync(all, m, o);
        int a2 = __shfl_xor_sync(all, arg, o);
        bad += __shfl_xor_sync(all, bad, o);
        if (m2 > m || (m2 == m && a2 >= 0 && (arg < 0 || a2 < arg))) { m = m2; arg = a2; }
    }
    if (lane == 0) { wmax[w] = m; warg[w] = arg; wbad[w] = bad; }
    __syncthreads();
    float M = -LLMC_INF;
    int A = -1, nbad = 0;
    for (int k = 0; k < SAMPLE_WARPS; k++) {  // in id order: the first largest wins a tie
        nbad += wbad[k];
        if (wmax[k] > M) { M = wmax[k]; A = warg[k]; }
    }
    if (nbad || A < 0 || temperature <= 0.0) {
        if (threadIdx.x == 0) { out[0] = A < 0 ? 0 : A; out[1] = nbad ? nbad : (A < 0 ? V : 0); }
        return;
    }
    double mt = (double)M / temperature;  // max(x / T): division by T > 0 keeps the order
    double s = 0.0;
    for (int i = lo + lane; i < hi; i += 32) s += exp((double)to_f(logits[i]) / temperature - mt);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(all, s, o);
    if (lane == 0) wsum[w] = s;
    __syncthreads();
    if (threadIdx.x == 0) {  // the warp whose ids hold the crossing (the last with any mass if rounding hides it)
        double total = 0.0, acc = 0.0;
        for (int k = 0; k < SAMPLE_WARPS; k++) total += wsum[k];
        double target = u * total;
        int pick = -1;
        double pick_base = 0.0;
        for (int k = 0; k < SAMPLE_WARPS; k++) {
            if (wsum[k] > 0.0) {
                pick = k; pick_base = acc;
                if (acc + wsum[k] > target) break;
            }
            acc += wsum[k];
        }
        who_s = pick; base_s = pick_base; target_s = target;
    }
    __syncthreads();
    if (w != who_s) return;
    double acc = base_s, target = target_s;
    int tok = -1, last = lo;
    for (int r = lo; r < hi; r += 32) {  // 32 ids at a time: their running sums by a scan over the lanes
        int i = r + lane;
        double e = i < hi ? exp((double)to_f(logits[i]) / temperature - mt) : 0.0;
        double c = e;
        for (int o = 1; o < 32; o <<= 1) {
            double y = __shfl_up_sync(all, c, o);
            if (lane >= o) c += y;
        }
        unsigned hit = __ballot_sync(all, e > 0.0 && acc + c > target);
        unsigned mass = __ballot_sync(all, e > 0.0);
        if (mass) last = r + 31 - __clz(mass);
        if (hit) { tok = r + __ffs(hit) - 1; break; }
        acc += __shfl_sync(all, c, 31);
    }
    if (lane == 0) { out[0] = tok >= 0 ? tok : last; out[1] = 0; }
}

// ---------------------------------------------------------------------------------------------------------
// attention over a key/value cache (decoding). Caches (B,NKV,S,hd) are rings: position p lives in slot p % S.
// New tokens' qkv rows are (B,Tn,(NH+2NKV)*hd) at positions pos..pos+Tn-1.
extern "C" __global__ void kv_cache_append(act_t* kc, act_t* vc, const act_t* qkv, int B, int Tn, int NH, int NKV,
                                           int hd, int S, long long pos_v, const int* pos_p) {
    long long pos = pos_p ? (long long)pos_p[0] : pos_v;
    long long n = (long long)B * Tn * NKV * hd;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        int d = (int)(i % hd);
        long long r = i / hd;
        int h = (int)(r % NKV);
        r /= NKV;
        int t = (int)(r % Tn);
        long long b = r / Tn;
        const act_t* src = qkv + (b * Tn + t) * (long long)((NH + 2 * NKV) * hd);
        long long dst = ((b * NKV + h) * S + (pos + t) % S) * hd + d;
        kc[dst] = src[(NH + h) * hd + d];
        vc[dst] = src[(NH + NKV + h) * hd + d];
    }
}

// max or sum over the block (blockDim a multiple of 32, at most 1024), every thread gets it; fixed order
__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();  // red may still be read by the previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nw ? red[lane] : (is_max ? -LLMC_INF : 0.0f);
    return is_max ? warp_max(v) : warp_sum(v);
}

// Split over the keys (flash-decoding): block (row, split) with row = (b, h, t) takes the keys
// split*DECODE_SPLIT .. +DECODE_SPLIT of the positions the row sees (the S up to its own): thread j scores key j
// (its row read in 16-byte packs when vec), then item (g, d) sums p_j v_j[d] over keys g, g + groups, ...; the
// block writes its partial softmax, max m, sum l and the unnormalised output acc (hd), into
// part[(row * splits + split) * (hd + 2) ..]; attention_decode_combine merges the splits in a fixed order. Many
// small blocks: one token's attention is a few microseconds of latency-bound loads per block, run side by side.
// The position comes from pos_p[0] when pos_p is given (a captured graph replays with a new one), else from pos_v;
// the grid is fixed by S, so a split past the row's keys only writes an empty partial. blockDim == DECODE_SPLIT.
#define DECODE_SPLIT 64
extern "C" __global__ void attention_decode_part(float* part, const act_t* qkv, const act_t* kc, const act_t* vc,
                                                 int Tn, int NH, int NKV, int hd, int S, long long pos_v,
                                                 const int* pos_p, float scale, int vec) {
    __shared__ float qs[256];
    __shared__ float ps[DECODE_SPLIT];
    __shared__ float red[32];
    __shared__ float accs[256];
    long long row = blockIdx.x;
    int split = blockIdx.y, splits = gridDim.y;
    int t = (int)(row % Tn);
    int h = (int)((row / Tn) % NH);
    long long b = row / ((long long)Tn * NH);
    long long pos = pos_p ? (long long)pos_p[0] : pos_v;
    long long hi = pos + t, lo = hi - S + 1 > 0 ? hi - S + 1 : 0;
    int n = (int)(hi - lo + 1), j0 = split * DECODE_SPLIT;
    float* out = part + (row * splits + split) * (long long)(hd + 2);
    if (j0 >= n) {  // a split past the row's keys: nothing, written in full (the combine multiplies its sums by 0,
        // and stale scratch could hold NaN)
        for (int d = threadIdx.x; d < hd; d += blockDim.x) out[d] = 0.0f;
        if (threadIdx.x == 0) { out[hd] = -LLMC_INF; out[hd + 1] = 0.0f; }
        return;
    }
    int cnt = min(DECODE_SPLIT, n - j0);
    int W = (NH + 2 * NKV) * hd, kvh = h / (NH / NKV);
    const act_t* q = qkv + (b * Tn + t) * W + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = to_f(q[d]) * scale;
    __syncthreads();
    const act_t* K = kc + (b * NKV + kvh) * (long long)S * hd;
    const act_t* V = vc + (b * NKV + kvh) * (long long)S * hd;
    int slot0 = (int)((lo + j0) % S);
    float sc = -LLMC_INF;
    if ((int)threadIdx.x < cnt) {
        int slot = slot0 + threadIdx.x;
        if (slot >= S) slot -= S;
        const act_t* k = K + (long long)slot * hd;
        float dot = 0.0f;
        if (vec) {
            for (int c = 0; c < hd; c += PACK) {
                pack_t kp = load_pack(k + c);
#pragma unroll
                for (int i = 0; i < PACK; i++) dot += qs[c + i] * to_f(kp.v[i]);
            }
        } else {
            for (int c = 0; c < hd; c++) dot += qs[c] * to_f(k[c]);
        }
        sc = dot;
    }
    float m = block_reduce(sc, red, true);
    float e = (int)threadIdx.x < cnt ? expf(sc - m) : 0.0f;
    ps[threadIdx.x] = e;
    float l = block_reduce(e, red, false);  // (its barriers also publish ps)
    int groups = max(1, (int)blockDim.x / hd);
    for (int i = threadIdx.x; i < groups * hd; i += blockDim.x) {
        int g = i / hd, d = i % hd;
        float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;  // four chains keep four loads in flight
        int jj = g, slot = slot0 + g;
        for (; jj + 3 * groups < cnt; jj += 4 * groups) {
            int s0 = slot0 + jj, s1 = s0 + groups, s2 = s1 + groups, s3 = s2 + groups;
            s0 -= s0 >= S ? S : 0; s1 -= s1 >= S ? S : 0; s2 -= s2 >= S ? S : 0; s3 -= s3 >= S ? S : 0;
            a0 += ps[jj] * to_f(V[(long long)s0 * hd + d]);
            a1 += ps[jj + groups] * to_f(V[(long long)s1 * hd + d]);
            a2 += ps[jj + 2 * groups] * to_f(V[(long long)s2 * hd + d]);
            a3 += ps[jj + 3 * groups] * to_f(V[(long long)s3 * hd + d]);
        }
        for (; jj < cnt; jj += groups) {
            slot = slot0 + jj;
            slot -= slot >= S ? S : 0;
            a0 += ps[jj] * to_f(V[(long long)slot * hd + d]);
        }
        accs[i] = (a0 + a1) + (a2 + a3);
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int gg = 0; gg < groups; gg++) a += accs[gg * hd + d];
        out[d] = a;
    }
    if (threadIdx.x == 0) { out[hd] = m; out[hd + 1] = l; }
}

// out[row] = sum_s acc_s * e^(m_s - M) / sum_s l_s * e^(m_s - M), M = max_s m_s, splits merged in order
extern "C" __global__ void attention_decode_combine(act_t* out, const float* part, int Tn, int NH, int hd,
                                                    int splits) {
    long long row = blockIdx.x;
    const float* p = part + row * splits * (long long)(hd + 2);
    float M = -LLMC_INF;
    for (int s = 0; s < splits; s++) M = fmaxf(M, p[s * (hd + 2) + hd]);
    float L = 0.0f;
    for (int s = 0; s < splits; s++) L += p[s * (hd + 2) + hd + 1] * expf(p[s * (hd + 2) + hd] - M);
    int t = (int)(row % Tn), h = (int)((row / Tn) % NH);
    long long b = row / ((long long)Tn * NH);
    act_t* o = out + (b * Tn + t) * NH * hd + h * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) {
            float w = expf(p[s * (hd + 2) + hd] - M);  // an empty split: e^-inf = 0
            a += p[s * (hd + 2) + d] * w;
        }
        o[d] = from_f(a / L);
    }
}

// ---------------------------------------------------------------------------------------------------------
// own attention (fp32 mode, shapes cuDNN cannot plan, GQA): correct and deterministic, not fast.
// qkv (B,T,W) with W = (NH+2NKV)*hd; out (B,T,NH*hd); lse (B,NH,T). One warp per (b, h, t) query row;
// scores of the row are kept in shared memory (T floats per warp).
extern "C" __global__ void attention_forward_ref(act_t* out, float* lse, const act_t* qkv, int B, int T, int NH,
                                                 int NKV, int hd, float scale) {
    extern __shared__ float sm[];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long rowid = (long long)blockIdx.x * warps + warp;
    if (rowid >= (long long)B * NH * T) return;
    int t = (int)(rowid % T);
    int h = (int)((rowid / T) % NH);
    int b = (int)(rowid / ((long long)T * NH));
    int W = (NH + 2 * NKV) * hd;
    int kvh = h / (NH / NKV);
    float* s = sm + (long long)warp * T;
    const act_t* q = qkv + ((long long)b * T + t) * W + h * hd;
    float mx = -LLMC_INF;
    for (int j = lane; j <= t; j += 32) {
        const act_t* k = qkv + ((long long)b * T + j) * W + (NH + kvh) * hd;
        float d = 0.0f;
        for (int i = 0; i < hd; i++) d += to_f(q[i]) * to_f(k[i]);
        d *= scale;
        s[j] = d;
        mx = fmaxf(mx, d);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int j = lane; j <= t; j += 32) sum += expf(s[j] - mx);
    sum = warp_sum(sum);
    float l = mx + logf(sum);
    __syncwarp();
    for (int j = lane; j <= t; j += 32) s[j] = expf(s[j] - l);
    __syncwarp();
    act_t* o = out + ((long long)b * T + t) * NH * hd + h * hd;
    for (int i = lane; i < hd; i += 32) {
        float acc = 0.0f;
        for (int j = 0; j <= t; j++) acc += s[j] * to_f(qkv[((long long)b * T + j) * W + (NH + NKV + kvh) * hd + i]);
        o[i] = from_f(acc);
    }
    if (lane == 0) lse[((long long)b * NH + h) * T + t] = l;
}

// backward 1: per query row: Dsum[b,h,t] = dO.O, and dq = scale * sum_j dS[t,j] k_j
extern "C" __global__ void attention_backward_dq_ref(act_t* dqkv, float* Dsum, const act_t* dout, const act_t* qkv,
                                                     const act_t* out, const float* lse, int B, int T, int NH,
                                                     int NKV, int hd, float scale) {
    extern __shared__ float sm[];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long rowid = (long long)blockIdx.x * warps + warp;
    if (rowid >= (long long)B * NH * T) return;
    int t = (int)(rowid % T);
    int h = (int)((rowid / T) % NH);
    int b = (int)(rowid / ((long long)T * NH));
    int W = (NH + 2 * NKV) * hd;
    int kvh = h / (NH / NKV);
    float* s = sm + (long long)warp * T;
    const act_t* q = qkv + ((long long)b * T + t) * W + h * hd;
    const act_t* dO = dout + ((long long)b * T + t) * NH * hd + h * hd;
    const act_t* O = out + ((long long)b * T + t) * NH * hd + h * hd;
    float D = 0.0f;
    for (int i = lane; i < hd; i += 32) D += to_f(dO[i]) * to_f(O[i]);
    D = warp_sum(D);
    float l = lse[((long long)b * NH + h) * T + t];
    for (int j = lane; j <= t; j += 32) {
        const act_t* k = qkv + ((long long)b * T + j) * W + (NH + kvh) * hd;
        const act_t* v = qkv + ((long long)b * T + j) * W + (NH + NKV + kvh) * hd;
        float d = 0.0f, dp = 0.0f;
        for (int i = 0; i < hd; i++) { d += to_f(q[i]) * to_f(k[i]); dp += to_f(dO[i]) * to_f(v[i]); }
        float p = expf(d * scale - l);
        s[j] = p * (dp - D);
    }
    __syncwarp();
    act_t* dq = dqkv + ((long long)b * T + t) * W + h * hd;
    for (int i = lane; i < hd; i += 32) {
        float acc = 0.0f;
        for (int j = 0; j <= t; j++) acc += s[j] * to_f(qkv[((long long)b * T + j) * W + (NH + kvh) * hd + i]);
        dq[i] = from_f(acc * scale);
    }
    if (lane == 0) Dsum[((long long)b * NH + h) * T + t] = D;
}

// backward 2: per key row j of kv head kvh: dk = scale * sum_{h in group} sum_{t>=j} dS[t,j] q_t,
// dv = sum_{h in group} sum_{t>=j} P[t,j] dO_t. Shared memory: 2*T floats per warp.
extern "C" __global__ void attention_backward_dkv_ref(act_t* dqkv, const float* Dsum, const act_t* dout,
                                                      const act_t* qkv, const float* lse, int B, int T, int NH,
                                                      int NKV, int hd, float scale) {
    extern __shared__ float sm[];
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    long long rowid = (long long)blockIdx.x * warps + warp;
    if (rowid >= (long long)B * NKV * T) return;
    int j = (int)(rowid % T);
    int kvh = (int)((rowid / T) % NKV);
    int b = (int)(rowid / ((long long)T * NKV));
    int W = (NH + 2 * NKV) * hd;
    int group = NH / NKV;
    float* ps = sm + (long long)warp * 2 * T;
    float* ds = ps + T;
    const act_t* k = qkv + ((long long)b * T + j) * W + (NH + kvh) * hd;
    const act_t* v = qkv + ((long long)b * T + j) * W + (NH + NKV + kvh) * hd;
    act_t* dk = dqkv + ((long long)b * T + j) * W + (NH + kvh) * hd;
    act_t* dv = dqkv + ((long long)b * T + j) * W + (NH + NKV + kvh) * hd;
    // accumulators for dims lane, lane+32, ... kept in registers (hd <= 32 * 8)
    float adk[8], adv[8];
    #pragma unroll
    for (int u = 0; u < 8; u++) { adk[u] = 0.0f; adv[u] = 0.0f; }
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        for (int t = j + lane; t < T; t += 32) {
            const act_t* q = qkv + ((long long)b * T + t) * W + h * hd;
            const act_t* dO = dout + ((long long)b * T + t) * NH * hd + h * hd;
            float d = 0.0f, dp = 0.0f;
            for (int i = 0; i < hd; i++) { d += to_f(q[i]) * to_f(k[i]); dp += to_f(dO[i]) * to_f(v[i]); }
            long long li = ((long long)b * NH + h) * T + t;
            float p = expf(d * scale - lse[li]);
            ps[t] = p;
            ds[t] = p * (dp - Dsum[li]);
        }
        __syncwarp();
        #pragma unroll
        for (int u = 0; u < 8; u++) {
            int i = lane + 32 * u;
            if (i < hd) {
                float ak = 0.0f, av = 0.0f;
                for (int t = j; t < T; t++) {
                    ak += ds[t] * to_f(qkv[((long long)b * T + t) * W + h * hd + i]);
                    av += ps[t] * to_f(dout[((long long)b * T + t) * NH * hd + h * hd + i]);
                }
                adk[u] += ak; adv[u] += av;
            }
        }
        __syncwarp();
    }
    #pragma unroll
    for (int u = 0; u < 8; u++) {
        int i = lane + 32 * u;
        if (i < hd) { dk[i] = from_f(adk[u] * scale); dv[i] = from_f(adv[u]); }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Tiled attention (flash attention's order of work, on CUDA cores in float32): what runs where cuDNN does not
// (--dtype fp32, or shapes it cannot plan) for head sizes 64 and 128. Same layouts as the _ref kernels above. A
// block owns a 64-row tile of queries (forward, dq) or keys (dk/dv) of one (b, head) and walks the tiles of the
// other side through shared memory, so nothing of size T x T is ever kept; 256 threads as 16 x 16, each owning 4
// rows x 4 columns of a score tile. Every sum has a fixed order (no atomics): deterministic.
#define AT_TILE 64
#define AT_THREADS 256

template <int HD> struct AttTile {
    static constexpr int LD = HD + 4;         // row stride of a (64, HD) tile in shared memory (float4, no conflicts)
    static constexpr int PLD = AT_TILE + 4;   // row stride of a (64, 64) score tile
    static constexpr int CH = HD / 64;        // float4 columns of HD per thread (tx + 16 * jj)
};

// rows [row0, row0 + 64) of one head's HD columns (row stride `ld` elements, `col` the head's first column) into
// shared memory as float, times `mul`; rows >= T as zeros
template <int HD>
__device__ __forceinline__ void at_load(float* dst, const act_t* src, long long row0, int T, int t0, long long ld,
                                        int col, float mul) {
    for (int idx = threadIdx.x; idx < AT_TILE * HD; idx += AT_THREADS) {
        int r = idx / HD, d = idx % HD;
        float v = 0.0f;
        if (t0 + r < T) v = to_f(src[(row0 + r) * ld + col + d]) * mul;
        dst[r * AttTile<HD>::LD + d] = v;
    }
}

// s[i][k] = sum_d A[ty*4+i][d] * B[tx+16k][d] over a (64, HD) pair of tiles (scores of 4 rows x 4 columns)
template <int HD>
__device__ __forceinline__ void at_scores(float s[4][4], const float* A, const float* Bm, int ty, int tx) {
    constexpr int LD = AttTile<HD>::LD;
    #pragma unroll
    for (int i = 0; i < 4; i++)
        #pragma unroll
        for (int k = 0; k < 4; k++) s[i][k] = 0.0f;
    #pragma unroll 4
    for (int d = 0; d < HD; d += 4) {
        float4 a[4], b[4];
        #pragma unroll
        for (int i = 0; i < 4; i++) a[i] = *reinterpret_cast<const float4*>(A + (ty * 4 + i) * LD + d);
        #pragma unroll
        for (int k = 0; k < 4; k++) b[k] = *reinterpret_cast<const float4*>(Bm + (tx + 16 * k) * LD + d);
        #pragma unroll
        for (int i = 0; i < 4; i++)
            #pragma unroll
            for (int k = 0; k < 4; k++)
                s[i][k] += a[i].x * b[k].x + a[i].y * b[k].y + a[i].z * b[k].z + a[i].w * b[k].w;
    }
}

// acc[i][jj] += sum_c P[ty*4+i][c] * M[c][(tx+16jj)*4 ..+4] over the 64 columns of a score tile
template <int HD>
__device__ __forceinline__ void at_accumulate(float4 acc[4][AttTile<HD>::CH], const float* P, const float* M,
                                              int ty, int tx) {
    constexpr int LD = AttTile<HD>::LD, PLD = AttTile<HD>::PLD, CH = AttTile<HD>::CH;
    #pragma unroll 2
    for (int c = 0; c < AT_TILE; c += 4) {
        float4 p[4];
        #pragma unroll
        for (int i = 0; i < 4; i++) p[i] = *reinterpret_cast<const float4*>(P + (ty * 4 + i) * PLD + c);
        #pragma unroll
        for (int jj = 0; jj < CH; jj++) {
            int d = (tx + 16 * jj) * 4;
            float4 m0 = *reinterpret_cast<const float4*>(M + (c + 0) * LD + d);
            float4 m1 = *reinterpret_cast<const float4*>(M + (c + 1) * LD + d);
            float4 m2 = *reinterpret_cast<const float4*>(M + (c + 2) * LD + d);
            float4 m3 = *reinterpret_cast<const float4*>(M + (c + 3) * LD + d);
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                acc[i][jj].x += p[i].x * m0.x + p[i].y * m1.x + p[i].z * m2.x + p[i].w * m3.x;
                acc[i][jj].y += p[i].x * m0.y + p[i].y * m1.y + p[i].z * m2.y + p[i].w * m3.y;
                acc[i][jj].z += p[i].x * m0.z + p[i].y * m1.z + p[i].z * m2.z + p[i].w * m3.z;
                acc[i][jj].w += p[i].x * m0.w + p[i].y * m1.w + p[i].z * m2.w + p[i].w * m3.w;
            }
        }
    }
}

// the 16 threads of a row group (same ty: one half of a warp) combine their values
__device__ __forceinline__ float half_warp_max(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float half_warp_sum(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// a thread's accumulators (4 rows x CH float4 columns), cleared; and row i of them, times mul, stored into a row
// of HD outputs at the thread's columns (tx + 16 jj) * 4 .. + 4
template <int CH> __device__ __forceinline__ void at_clear(float4 a[4][CH]) {
    #pragma unroll
    for (int i = 0; i < 4; i++)
        #pragma unroll
        for (int jj = 0; jj < CH; jj++) a[i][jj] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}
template <int CH> __device__ __forceinline__ void at_store_row(act_t* dst, const float4 a[CH], float mul, int tx) {
    #pragma unroll
    for (int jj = 0; jj < CH; jj++) {
        int d = (tx + 16 * jj) * 4;
        dst[d] = from_f(a[jj].x * mul); dst[d + 1] = from_f(a[jj].y * mul);
        dst[d + 2] = from_f(a[jj].z * mul); dst[d + 3] = from_f(a[jj].w * mul);
    }
}

// grid (ceil(T/64), NH, B)
template <int HD>
__device__ void attention_forward_tiled(act_t* out, float* lse, const act_t* qkv, int T, int NH, int NKV,
                                        float scale) {
    constexpr int LD = AttTile<HD>::LD, PLD = AttTile<HD>::PLD, CH = AttTile<HD>::CH;
    extern __shared__ float4 at_smem4[];
    float* Qs = reinterpret_cast<float*>(at_smem4);
    float* Ks = Qs + AT_TILE * LD;
    float* Vs = Ks + AT_TILE * LD;
    float* Ps = Vs + AT_TILE * LD;
    int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int W = (NH + 2 * NKV) * HD, kvh = h / (NH / NKV);
    int q0 = qt * AT_TILE;
    long long base = (long long)b * T;
    at_load<HD>(Qs, qkv, base + q0, T, q0, W, h * HD, scale);
    float m[4], l[4];
    float4 acc[4][CH];
    at_clear<CH>(acc);
    #pragma unroll
    for (int i = 0; i < 4; i++) { m[i] = -LLMC_INF; l[i] = 0.0f; }
    for (int kt = 0; kt <= qt; kt++) {
        int k0 = kt * AT_TILE;
        __syncthreads();  // the previous tile's K, V, P are used up
        at_load<HD>(Ks, qkv, base + k0, T, k0, W, (NH + kvh) * HD, 1.0f);
        at_load<HD>(Vs, qkv, base + k0, T, k0, W, (NH + NKV + kvh) * HD, 1.0f);
        __syncthreads();
        float s[4][4];
        at_scores<HD>(s, Qs, Ks, ty, tx);
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = q0 + ty * 4 + i;
            float mx = -LLMC_INF;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                int c = k0 + tx + 16 * k;
                if (c > r || c >= T) s[i][k] = -LLMC_INF;
                mx = fmaxf(mx, s[i][k]);
            }
            float mnew = fmaxf(m[i], half_warp_max(mx));
            float corr = mnew == -LLMC_INF ? 1.0f : expf(m[i] - mnew);
            float sum = 0.0f;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                float p = mnew == -LLMC_INF ? 0.0f : expf(s[i][k] - mnew);
                Ps[(ty * 4 + i) * PLD + tx + 16 * k] = p;
                sum += p;
            }
            l[i] = l[i] * corr + half_warp_sum(sum);
            m[i] = mnew;
            #pragma unroll
            for (int jj = 0; jj < CH; jj++) {
                acc[i][jj].x *= corr; acc[i][jj].y *= corr; acc[i][jj].z *= corr; acc[i][jj].w *= corr;
            }
        }
        __syncthreads();
        at_accumulate<HD>(acc, Ps, Vs, ty, tx);
    }
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = q0 + ty * 4 + i;
        if (t >= T) continue;
        at_store_row<CH>(out + (base + t) * NH * HD + h * HD, acc[i], 1.0f / l[i], tx);
        if (tx == 0) lse[((long long)b * NH + h) * T + t] = m[i] + logf(l[i]);
    }
}

// Dsum[b,h,t] = dO[b,t,h] . O[b,t,h], one warp per row (the backward kernels read it for every score)
extern "C" __global__ void attention_backward_dsum(float* Dsum, const act_t* dout, const act_t* out, int B, int T,
                                                   int NH, int hd) {
    long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= (long long)B * NH * T) return;
    int t = (int)(row % T), h = (int)((row / T) % NH);
    long long b = row / ((long long)T * NH);
    const act_t* dO = dout + (b * T + t) * NH * hd + h * hd;
    const act_t* O = out + (b * T + t) * NH * hd + h * hd;
    float D = 0.0f;
    for (int i = lane; i < hd; i += 32) D += to_f(dO[i]) * to_f(O[i]);
    D = warp_sum(D);
    if (lane == 0) Dsum[(b * NH + h) * T + t] = D;
}

// dk, dv of one 64-key tile of kv head kvh: over the heads of its group and the query tiles at or after it,
// S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - D); dv += P^T dO, dk += dS^T Q.
// grid (ceil(T/64), NKV, B)
template <int HD>
__device__ void attention_backward_dkv_tiled(act_t* dqkv, const float* Dsum, const act_t* dout, const act_t* qkv,
                                             const float* lse, int T, int NH, int NKV, float scale) {
    constexpr int LD = AttTile<HD>::LD, PLD = AttTile<HD>::PLD, CH = AttTile<HD>::CH;
    extern __shared__ float4 at_smem4[];
    float* Ks = reinterpret_cast<float*>(at_smem4);
    float* Vs = Ks + AT_TILE * LD;
    float* Qs = Vs + AT_TILE * LD;
    float* dOs = Qs + AT_TILE * LD;
    float* Pt = dOs + AT_TILE * LD;
    float* dSt = Pt + AT_TILE * PLD;
    float* lse_s = dSt + AT_TILE * PLD;
    float* D_s = lse_s + AT_TILE;
    int kt = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int W = (NH + 2 * NKV) * HD, group = NH / NKV, nt = (T + AT_TILE - 1) / AT_TILE;
    int k0 = kt * AT_TILE;
    long long base = (long long)b * T;
    at_load<HD>(Ks, qkv, base + k0, T, k0, W, (NH + kvh) * HD, 1.0f);
    at_load<HD>(Vs, qkv, base + k0, T, k0, W, (NH + NKV + kvh) * HD, 1.0f);
    float4 dk[4][CH], dv[4][CH];
    at_clear<CH>(dk);
    at_clear<CH>(dv);
    for (int g = 0; g < group; g++) {
        int h = kvh * group + g;
        for (int qt = kt; qt < nt; qt++) {
            int q0 = qt * AT_TILE;
            __syncthreads();  // the previous query tile is used up
            at_load<HD>(Qs, qkv, base + q0, T, q0, W, h * HD, 1.0f);
            at_load<HD>(dOs, dout, base + q0, T, q0, (long long)NH * HD, h * HD, 1.0f);
            for (int r = threadIdx.x; r < AT_TILE; r += AT_THREADS) {
                bool ok = q0 + r < T;
                long long li = ((long long)b * NH + h) * T + q0 + r;
                lse_s[r] = ok ? lse[li] : LLMC_INF;  // a row past T: P = 0
                D_s[r] = ok ? Dsum[li] : 0.0f;
            }
            __syncthreads();
            float s[4][4], dp[4][4];
            at_scores<HD>(s, Ks, Qs, ty, tx);   // s[i][k]: key ty*4+i, query tx+16k
            at_scores<HD>(dp, Vs, dOs, ty, tx);
            #pragma unroll
            for (int i = 0; i < 4; i++) {
                int kj = k0 + ty * 4 + i;
                #pragma unroll
                for (int k = 0; k < 4; k++) {
                    int qc = tx + 16 * k;
                    float p = (q0 + qc < kj) ? 0.0f : expf(s[i][k] * scale - lse_s[qc]);
                    Pt[(ty * 4 + i) * PLD + qc] = p;
                    dSt[(ty * 4 + i) * PLD + qc] = p * (dp[i][k] - D_s[qc]);
                }
            }
            __syncthreads();
            at_accumulate<HD>(dv, Pt, dOs, ty, tx);
            at_accumulate<HD>(dk, dSt, Qs, ty, tx);
        }
    }
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = k0 + ty * 4 + i;
        if (t >= T) continue;
        at_store_row<CH>(dqkv + (base + t) * W + (NH + kvh) * HD, dk[i], scale, tx);
        at_store_row<CH>(dqkv + (base + t) * W + (NH + NKV + kvh) * HD, dv[i], 1.0f, tx);
    }
}

// dq of one 64-query tile of head h: over the key tiles up to it, S = Q K^T, P = exp(scale S - lse),
// dP = dO V^T, dS = P (dP - D); dq += dS K. grid (ceil(T/64), NH, B)
template <int HD>
__device__ void attention_backward_dq_tiled(act_t* dqkv, const float* Dsum, const act_t* dout, const act_t* qkv,
                                            const float* lse, int T, int NH, int NKV, float scale) {
    constexpr int LD = AttTile<HD>::LD, PLD = AttTile<HD>::PLD, CH = AttTile<HD>::CH;
    extern __shared__ float4 at_smem4[];
    float* Qs = reinterpret_cast<float*>(at_smem4);
    float* dOs = Qs + AT_TILE * LD;
    float* Ks = dOs + AT_TILE * LD;
    float* Vs = Ks + AT_TILE * LD;
    float* dS = Vs + AT_TILE * LD;
    int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int W = (NH + 2 * NKV) * HD, kvh = h / (NH / NKV);
    int q0 = qt * AT_TILE;
    long long base = (long long)b * T;
    at_load<HD>(Qs, qkv, base + q0, T, q0, W, h * HD, 1.0f);
    at_load<HD>(dOs, dout, base + q0, T, q0, (long long)NH * HD, h * HD, 1.0f);
    float lrow[4], Drow[4];
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = q0 + ty * 4 + i;
        long long li = ((long long)b * NH + h) * T + t;
        lrow[i] = t < T ? lse[li] : LLMC_INF;
        Drow[i] = t < T ? Dsum[li] : 0.0f;
    }
    float4 dq[4][CH];
    at_clear<CH>(dq);
    for (int kt = 0; kt <= qt; kt++) {
        int k0 = kt * AT_TILE;
        __syncthreads();
        at_load<HD>(Ks, qkv, base + k0, T, k0, W, (NH + kvh) * HD, 1.0f);
        at_load<HD>(Vs, qkv, base + k0, T, k0, W, (NH + NKV + kvh) * HD, 1.0f);
        __syncthreads();
        float s[4][4], dp[4][4];
        at_scores<HD>(s, Qs, Ks, ty, tx);
        at_scores<HD>(dp, dOs, Vs, ty, tx);
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int r = q0 + ty * 4 + i;
            #pragma unroll
            for (int k = 0; k < 4; k++) {
                int c = k0 + tx + 16 * k;
                float p = (c > r || c >= T) ? 0.0f : expf(s[i][k] * scale - lrow[i]);
                dS[(ty * 4 + i) * PLD + tx + 16 * k] = p * (dp[i][k] - Drow[i]);
            }
        }
        __syncthreads();
        at_accumulate<HD>(dq, dS, Ks, ty, tx);
    }
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        int t = q0 + ty * 4 + i;
        if (t >= T) continue;
        at_store_row<CH>(dqkv + (base + t) * W + h * HD, dq[i], scale, tx);
    }
}

#define AT_ENTRY(HD)                                                                                              \
extern "C" __global__ void __launch_bounds__(AT_THREADS) attention_forward_tiled_##HD(                           \
    act_t* out, float* lse, const act_t* qkv, int T, int NH, int NKV, float scale) {                              \
    attention_forward_tiled<HD>(out, lse, qkv, T, NH, NKV, scale);                                                \
}                                                                                                                 \
extern "C" __global__ void __launch_bounds__(AT_THREADS) attention_backward_dkv_tiled_##HD(                      \
    act_t* dqkv, const float* Dsum, const act_t* dout, const act_t* qkv, const float* lse, int T, int NH, int NKV, \
    float scale) {                                                                                                \
    attention_backward_dkv_tiled<HD>(dqkv, Dsum, dout, qkv, lse, T, NH, NKV, scale);                              \
}                                                                                                                 \
extern "C" __global__ void __launch_bounds__(AT_THREADS) attention_backward_dq_tiled_##HD(                       \
    act_t* dqkv, const float* Dsum, const act_t* dout, const act_t* qkv, const float* lse, int T, int NH, int NKV, \
    float scale) {                                                                                                \
    attention_backward_dq_tiled<HD>(dqkv, Dsum, dout, qkv, lse, T, NH, NKV, scale);                               \
}
AT_ENTRY(64)
AT_ENTRY(128)
