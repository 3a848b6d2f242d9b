// The copy/compute overlap experiment's two float32 layernorm forwards (`llmc bench overlap`, overlap.py beside
// this file), as the CUDA backend's overlap.cu has them. Buffers are (base pointer, element offset) pairs as in
// kernels.cl. inp, out (N,C) row-major; mean, rstd (N,); weight, bias (C,); eps 1e-5 as layernorm_forward.

#pragma OPENCL FP_CONTRACT OFF

#ifndef LS
#define LS 256
#endif
#define LANES 32  // work-items per row in overlap_layernorm_rows: a CUDA warp's worth

// llm.c's kernel 1: one work-item per row, three passes over it (neighbouring items read C floats apart)
__kernel void overlap_layernorm_naive(__global float* out, const long oo, __global float* mean, const long mo,
                                      __global float* rstd, const long ro, __global const float* inp, const long io,
                                      __global const float* w, const long wo, __global const float* b, const long bo,
                                      const int N, const int C) {
    const long row = get_global_id(0);
    if (row >= N) return;
    __global const float* x = inp + io + row * C;
    float m = 0.0f;
    for (int i = 0; i < C; i++) m += x[i];
    m = m / C;
    float v = 0.0f;
    for (int i = 0; i < C; i++) {
        const float d = x[i] - m;
        v += d * d;
    }
    v = v / C;
    const float s = 1.0f / sqrt(v + 1e-5f);
    __global float* o = out + oo + row * C;
    for (int i = 0; i < C; i++) o[i] = s * (x[i] - m) * w[wo + i] + b[bo + i];
    mean[mo + row] = m;
    rstd[ro + row] = s;
}

// sum of `v` over this row's LANES items (`s`: their LANES slots of local memory); every item of the work-group
// must call it, live row or not, since it holds barriers
inline float lane_sum(float v, __local float* s) {
    const int lane = get_local_id(0) % LANES;
    s[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int k = LANES / 2; k > 0; k >>= 1) {
        if (lane < k) s[lane] += s[lane + k];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = s[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // everyone has read s[0] before the next call writes it
    return r;
}

// llm.c's kernel 3 without warp shuffles: LANES items per row, LS / LANES rows per work-group; the items stride
// the row, so neighbouring items read neighbouring floats
__kernel __attribute__((reqd_work_group_size(LS, 1, 1)))
void overlap_layernorm_rows(__global float* out, const long oo, __global float* mean, const long mo,
                            __global float* rstd, const long ro, __global const float* inp, const long io,
                            __global const float* w, const long wo, __global const float* b, const long bo,
                            const int N, const int C) {
    __local float scratch[LS];
    const int lid = get_local_id(0), lane = lid % LANES;
    const long row = (long)get_group_id(0) * (LS / LANES) + lid / LANES;
    __local float* s = scratch + (lid / LANES) * LANES;
    const int live = row < N;
    __global const float* x = inp + io + row * C;
    float sum = 0.0f;
    if (live)
        for (int i = lane; i < C; i += LANES) sum += x[i];
    const float m = lane_sum(sum, s) / C;
    float v = 0.0f;
    if (live)
        for (int i = lane; i < C; i += LANES) {
            const float d = x[i] - m;
            v += d * d;
        }
    const float r = 1.0f / sqrt(lane_sum(v, s) / C + 1e-5f);
    if (!live) return;  // past the last barrier
    if (lane == 0) {
        mean[mo + row] = m;
        rstd[ro + row] = r;
    }
    __global float* o = out + oo + row * C;
    for (int i = lane; i < C; i += LANES) o[i] = r * (x[i] - m) * w[wo + i] + b[bo + i];
}
