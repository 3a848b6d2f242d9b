// llmc OpenCL backend: the "direct" SGEMM variant for CPU-like devices (PoCL and friends).
//
// Same arguments and semantics as sgemm.cl (see there), but no local memory and no barriers: on a CPU the
// caches do the staging, while barriers force PoCL to spill every work-item's registers between regions.
// Each work-item computes an RM x RN block of C with explicit vector types along the contiguous dimension of
// each layout, so the host compiler emits SIMD FMAs:
//   NN  C(m,:) += A(m,k) * B(k, n0:n0+RN)            (B rows contiguous along n)
//   TN  same, with A(m,k) read down a column of the stored (K,M) matrix
//   NT  dot products along k, RM x RN float4 accumulators (both operands contiguous along k)
// Blocks that straddle an edge of C take a scalar path with bounds checks.

#ifndef RM
#define RM 4
#endif
#ifndef RN
#define RN 8
#endif
#ifndef A_T
#define A_T 0
#endif
#ifndef B_T
#define B_T 0
#endif

#if A_T
#define AIDX(m, k) ((long)(k) * lda + (m))
#else
#define AIDX(m, k) ((long)(m) * lda + (k))
#endif
#if B_T
#define BIDX(k, n) ((long)(n) * ldb + (k))
#else
#define BIDX(k, n) ((long)(k) * ldb + (n))
#endif

#if RN == 8
#define VECN float8
#define VLOADN vload8
#define VSTOREN vstore8
#elif RN == 4
#define VECN float4
#define VLOADN vload4
#define VSTOREN vstore4
#elif RN == 16
#define VECN float16
#define VLOADN vload16
#define VSTOREN vstore16
#else
#error "RN must be 4, 8 or 16"
#endif

#ifndef VK
#define VK 4
#endif
#if VK == 4
#define VECK float4
#define VLOADK vload4
#define HSUM(x) (((x).s0 + (x).s1) + ((x).s2 + (x).s3))
#elif VK == 8
#define VECK float8
#define VLOADK vload8
#define HSUM(x) ((((x).s0 + (x).s1) + ((x).s2 + (x).s3)) + (((x).s4 + (x).s5) + ((x).s6 + (x).s7)))
#elif VK == 16
#define VECK float16
#define VLOADK vload16
#define HSUM(x) (HSUM8((x).lo) + HSUM8((x).hi))
#endif
#define HSUM8(x) ((((x).s0 + (x).s1) + ((x).s2 + (x).s3)) + (((x).s4 + (x).s5) + ((x).s6 + (x).s7)))

#define GELU_SCALING_FACTOR 0.7978845608028654f

__kernel void sgemm(const int M, const int N, const int K,
                    __global const float* restrict A, const long a_off, const int lda, const long a_so,
                    const long a_si, const int a_g,
                    __global const float* restrict B, const long b_off, const int ldb, const long b_so,
                    const long b_si, const int b_g,
                    __global float* C, const long c_off, const int ldc, const long c_so, const long c_si,
                    const int zdiv, const float alpha, const int accumulate,
                    __global const float* restrict bias, const long bias_off, const int has_bias,
                    __global float* aux, const long aux_off, const int epi, const int causal)
{
    const int n0 = get_global_id(0) * RN;
    const int m0 = get_global_id(1) * RM;
    const int z = get_global_id(2);
    if (m0 >= M || n0 >= N) return;
    if (causal == 2 && n0 > m0 + RM - 1) return;

    const int zo = z / zdiv, zi = z % zdiv;
    A += a_off + zo * a_so + (zi / a_g) * a_si;
    B += b_off + zo * b_so + (zi / b_g) * b_si;
    C += c_off + zo * c_so + zi * c_si;

    int kbeg = 0, kend = K;
    if (causal == 1) kend = min(K, m0 + RM);
    if (causal == 3) kbeg = m0;

    float acc[RM][RN];
    for (int i = 0; i < RM; i++)
        for (int j = 0; j < RN; j++) acc[i][j] = 0.0f;

    const bool full = (m0 + RM <= M) && (n0 + RN <= N);
    if (full) {
#if !B_T
        VECN accv[RM];
        for (int i = 0; i < RM; i++) accv[i] = (VECN)(0.0f);
        for (int k = kbeg; k < kend; k++) {
            const VECN b = VLOADN(0, B + (long)k * ldb + n0);
#pragma unroll
            for (int i = 0; i < RM; i++) accv[i] = fma((VECN)(A[AIDX(m0 + i, k)]), b, accv[i]);
        }
        for (int i = 0; i < RM; i++) VSTOREN(accv[i], 0, acc[i]);
#elif !A_T
        VECK acck[RM][RN];
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < RN; j++) acck[i][j] = (VECK)(0.0f);
        int k = kbeg;
        for (; k + VK <= kend; k += VK) {
            VECK a[RM];
#pragma unroll
            for (int i = 0; i < RM; i++) a[i] = VLOADK(0, A + (long)(m0 + i) * lda + k);
#pragma unroll
            for (int j = 0; j < RN; j++) {
                const VECK b = VLOADK(0, B + (long)(n0 + j) * ldb + k);
#pragma unroll
                for (int i = 0; i < RM; i++) acck[i][j] = fma(a[i], b, acck[i][j]);
            }
        }
        for (int i = 0; i < RM; i++)
            for (int j = 0; j < RN; j++) {
                float s = HSUM(acck[i][j]);
                for (int kk = k; kk < kend; kk++)
                    s = mad(A[(long)(m0 + i) * lda + kk], B[(long)(n0 + j) * ldb + kk], s);
                acc[i][j] = s;
            }
#else
        for (int k = kbeg; k < kend; k++)
            for (int i = 0; i < RM; i++)
                for (int j = 0; j < RN; j++) acc[i][j] = mad(A[AIDX(m0 + i, k)], B[BIDX(k, n0 + j)], acc[i][j]);
#endif
    } else {
        const int mi = min(RM, M - m0), nj = min(RN, N - n0);
        for (int k = kbeg; k < kend; k++)
            for (int i = 0; i < mi; i++) {
                const float a = A[AIDX(m0 + i, k)];
                for (int j = 0; j < nj; j++) acc[i][j] = mad(a, B[BIDX(k, n0 + j)], acc[i][j]);
            }
    }

    for (int i = 0; i < RM; i++) {
        const int m = m0 + i;
        if (m >= M) break;
        for (int j = 0; j < RN; j++) {
            const int n = n0 + j;
            if (n >= N) break;
            const long idx = (long)m * ldc + n;
            float v = alpha * acc[i][j];
            if (accumulate) v += C[idx];
            if (has_bias) v += bias[bias_off + n];
            if (epi == 1) {
                C[idx] = v;
                const float cube = 0.044715f * v * v * v;
                aux[aux_off + idx] = 0.5f * v * (1.0f + tanh(GELU_SCALING_FACTOR * (v + cube)));
            } else if (epi == 2) {
                const float x = aux[aux_off + idx];
                const float cube = 0.044715f * x * x * x;
                const float t = tanh(GELU_SCALING_FACTOR * (x + cube));
                const float sech2 = 1.0f - t * t;
                const float lg = 0.5f * (1.0f + t)
                                 + x * 0.5f * sech2 * GELU_SCALING_FACTOR * (1.0f + 3.0f * 0.044715f * x * x);
                C[idx] = v * lg;
            } else {
                C[idx] = v;
            }
        }
    }
}
