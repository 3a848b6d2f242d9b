// The copy/compute overlap experiment's two float32 layernorm forwards (`llmc bench overlap`, overlap.py beside
// this file). Kept apart from kernels.cu: the training kernels there are bf16/fp32 templates tuned for the
// step; these are the diary's two kernels as llm.c's dev/cuda/layernorm_forward.cu wrote them, nothing more.
// inp, out (N,C) row-major; mean, rstd (N,); weight, bias (C,); eps 1e-5 as layernorm_forward.

#define EPS 1e-5f

// llm.c's kernel 1: one thread per row, three passes over it. Neighbouring threads read addresses C floats
// apart, so the loads do not coalesce; it is what the diary ran over chunks on several streams.
extern "C" __global__ void overlap_layernorm_naive(float* out, float* mean, float* rstd, const float* inp,
                                                   const float* weight, const float* bias, int N, int C) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const float* x = inp + (size_t)row * C;
    float m = 0.0f;
    for (int i = 0; i < C; i++) m += x[i];
    m = m / C;
    float v = 0.0f;
    for (int i = 0; i < C; i++) {
        float d = x[i] - m;
        v += d * d;
    }
    v = v / C;
    float s = 1.0f / sqrtf(v + EPS);
    float* o = out + (size_t)row * C;
    for (int i = 0; i < C; i++) o[i] = s * (x[i] - m) * weight[i] + bias[i];
    mean[row] = m;
    rstd[row] = s;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
    return v;
}

// llm.c's kernel 3 (the one train_gpt2.cu long used): a warp per row, blockDim.x / 32 rows per block; lanes
// stride the row so that every load coalesces, warp shuffles reduce. The streaming hints (__ldcs, __stcs) keep
// x and out, each touched once here, from evicting the weight and bias every row reads from L2.
extern "C" __global__ void overlap_layernorm_warp(float* out, float* mean, float* rstd, const float* inp,
                                                  const float* weight, const float* bias, int N, int C) {
    int lane = threadIdx.x % 32;
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= N) return;  // the same for the whole warp, so the shuffles below see every lane
    const float* x = inp + (size_t)row * C;
    float sum = 0.0f;
    for (int i = lane; i < C; i += 32) sum += x[i];
    float m = warp_sum(sum) / C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float d = x[i] - m;
        v += d * d;
    }
    float s = rsqrtf(warp_sum(v) / C + EPS);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
    float* o = out + (size_t)row * C;
    for (int i = lane; i < C; i += 32) __stcs(o + i, s * (__ldcs(x + i) - m) * weight[i] + bias[i]);
}
