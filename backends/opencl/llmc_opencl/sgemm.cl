// llmc OpenCL backend: a tiled, register-blocked, batched SGEMM with fused epilogues.
//
//   C[z] (M,N) = alpha * op(A[z]) (M,K) @ op(B[z]) (K,N)   [+ C]   [+ bias]   [gelu epilogue]
//
// Compile-time parameters (chosen per device by the autotuner):
//   TM, TN   rows / columns of C computed by one work-group
//   TK       depth of the K slice staged in local memory per iteration
//   WPTM, WPTN  rows / columns of C held in registers by one work-item
//   A_T      0: A stored (M,K) row-major, A(m,k) = A[m*lda + k];  1: stored (K,M), A(m,k) = A[k*lda + m]
//   B_T      0: B stored (K,N) row-major, B(k,n) = B[k*ldb + n];  1: stored (N,K), B(k,n) = B[n*ldb + k]
// The work-group is (TN/WPTN, TM/WPTM); a work-item owns the strided rows tidm + i*RTM and columns
// tidn + j*RTN of the tile (conflict-free local-memory reads, coalesced stores). Edges (any M, N, K) are
// handled by zero-filling the staged tiles and guarding the stores.
//
// Batches: z = get_group_id(2); each operand X starts at
//   X + x_off + (z / zdiv) * x_so + ((z % zdiv) / x_g) * x_si
// which expresses the (batch, head) walk of attention over a packed qkv tensor, including grouped-query
// heads (x_g = NH / NKV), without copying.
//
// causal: 0 dense; 1 A is lower-triangular (A(m,k) = 0 for k > m: the K loop stops at the tile's last row);
//         2 only C(m,n) with n <= m is needed (tiles strictly above the diagonal are skipped, not written);
//         3 A is upper-triangular (A(m,k) = 0 for k < m: the K loop starts at the tile's first row).
// epi:    0 plain; 1 GELU forward: C receives the pre-activation, aux = gelu(C);
//         2 GELU backward: C = product * gelu'(aux) (aux holds the pre-activation).

#ifndef TM
#define TM 64
#endif
#ifndef TN
#define TN 64
#endif
#ifndef TK
#define TK 16
#endif
#ifndef WPTM
#define WPTM 4
#endif
#ifndef WPTN
#define WPTN 4
#endif
#ifndef A_T
#define A_T 0
#endif
#ifndef PREF
#define PREF 0
#endif
#ifndef B_T
#define B_T 0
#endif

#define RTM (TM / WPTM)
#define RTN (TN / WPTN)
#define NTHR (RTM * RTN)
#define PAD 1

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

#define GELU_SCALING_FACTOR 0.7978845608028654f

__kernel __attribute__((reqd_work_group_size(RTN, RTM, 1)))
void sgemm(const int M, const int N, const int K,
           __global const float* restrict A, const long a_off, const int lda, const long a_so, const long a_si,
           const int a_g,
           __global const float* restrict B, const long b_off, const int ldb, const long b_so, const long b_si,
           const int b_g,
           __global float* C, const long c_off, const int ldc, const long c_so, const long c_si,
           const int zdiv, const float alpha, const int accumulate,
           __global const float* restrict bias, const long bias_off, const int has_bias,
           __global float* aux, const long aux_off, const int epi, const int causal)
{
    const int tidn = get_local_id(0);
    const int tidm = get_local_id(1);
    const int n0 = get_group_id(0) * TN;
    const int m0 = get_group_id(1) * TM;
    const int z = get_group_id(2);
    if (causal == 2 && n0 > m0 + TM - 1) return;  // uniform over the work-group

    const int zo = z / zdiv, zi = z % zdiv;
    A += a_off + zo * a_so + (zi / a_g) * a_si;
    B += b_off + zo * b_so + (zi / b_g) * b_si;
    C += c_off + zo * c_so + zi * c_si;

    __local float As[TK][TM + PAD];
    __local float Bs[TK][TN + PAD];

    float acc[WPTM][WPTN];
    for (int i = 0; i < WPTM; i++)
        for (int j = 0; j < WPTN; j++) acc[i][j] = 0.0f;

    int kbeg = 0, kend = K;
    if (causal == 1) kend = min(K, m0 + TM);
    if (causal == 3) kbeg = (m0 / TK) * TK;
    const int tid = tidm * RTN + tidn;

#if PREF
    // register prefetch: the next K slice is read from global memory while the current one is multiplied
#define LA ((TM * TK + NTHR - 1) / NTHR)
#define LB ((TN * TK + NTHR - 1) / NTHR)
    float pa[LA], pb[LB];
#define FETCH(kt)                                                                          \
    for (int r = 0; r < LA; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        const int mm = A_T ? i % TM : i / TK, kk = A_T ? i / TM : i % TK;                  \
        const int gm = m0 + mm, gk = (kt) + kk;                                            \
        pa[r] = (i < TM * TK && gm < M && gk < kend) ? A[AIDX(gm, gk)] : 0.0f;             \
    }                                                                                      \
    for (int r = 0; r < LB; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        const int nn = B_T ? i / TK : i % TN, kk = B_T ? i % TK : i / TN;                  \
        const int gn = n0 + nn, gk = (kt) + kk;                                            \
        pb[r] = (i < TN * TK && gn < N && gk < kend) ? B[BIDX(gk, gn)] : 0.0f;             \
    }
    if (kbeg < kend) { FETCH(kbeg) }
#endif
    for (int kt = kbeg; kt < kend; kt += TK) {
#if PREF
        for (int r = 0; r < LA; r++) {
            const int i = tid + r * NTHR;
            if (i < TM * TK) {
                const int mm = A_T ? i % TM : i / TK, kk = A_T ? i / TM : i % TK;
                As[kk][mm] = pa[r];
            }
        }
        for (int r = 0; r < LB; r++) {
            const int i = tid + r * NTHR;
            if (i < TN * TK) {
                const int nn = B_T ? i / TK : i % TN, kk = B_T ? i % TK : i / TN;
                Bs[kk][nn] = pb[r];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (kt + TK < kend) { FETCH(kt + TK) }
#else
        for (int i = tid; i < TM * TK; i += NTHR) {
#if A_T
            const int mm = i % TM, kk = i / TM;
#else
            const int kk = i % TK, mm = i / TK;
#endif
            const int gm = m0 + mm, gk = kt + kk;
            As[kk][mm] = (gm < M && gk < kend) ? A[AIDX(gm, gk)] : 0.0f;
        }
        for (int i = tid; i < TN * TK; i += NTHR) {
#if B_T
            const int kk = i % TK, nn = i / TK;
#else
            const int nn = i % TN, kk = i / TN;
#endif
            const int gn = n0 + nn, gk = kt + kk;
            Bs[kk][nn] = (gn < N && gk < kend) ? B[BIDX(gk, gn)] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
#pragma unroll
        for (int kk = 0; kk < TK; kk++) {
            float ra[WPTM], rb[WPTN];
#pragma unroll
            for (int i = 0; i < WPTM; i++) ra[i] = As[kk][tidm + i * RTM];
#pragma unroll
            for (int j = 0; j < WPTN; j++) rb[j] = Bs[kk][tidn + j * RTN];
#pragma unroll
            for (int i = 0; i < WPTM; i++)
#pragma unroll
                for (int j = 0; j < WPTN; j++) acc[i][j] = mad(ra[i], rb[j], acc[i][j]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    for (int i = 0; i < WPTM; i++) {
        const int m = m0 + tidm + i * RTM;
        if (m >= M) continue;
        for (int j = 0; j < WPTN; j++) {
            const int n = n0 + tidn + j * RTN;
            if (n >= N) continue;
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
