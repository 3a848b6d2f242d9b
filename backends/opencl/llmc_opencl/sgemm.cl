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
//   PREF     1: the next K slice is read from global memory into registers while the current one is multiplied
//   VEC      1: a work-item owns groups of 4 adjacent rows / columns, (tidm + c*RTM)*4 + 0..3, so each K step
//               reads its operands from local memory as float4: a quarter of the shared-memory instructions,
//               which otherwise saturate the local-memory pipe before the FMA units (needs WPTM, WPTN % 4 == 0)
//   VA, VB   1 (with PREF): A / B are read from global memory as float4 along their contiguous dimension; the
//               host sets them only when offsets, strides and that dimension are multiples of 4 (and TK % 4 == 0
//               where that dimension is K)
// The work-group is (TN/WPTN, TM/WPTM); without VEC a work-item owns the strided rows tidm + i*RTM and columns
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
#ifndef VEC
#define VEC 0
#endif
#ifndef VA
#define VA 0
#endif
#ifndef VB
#define VB 0
#endif

#if VEC && (WPTM % 4 || WPTN % 4)
#error "VEC needs WPTM and WPTN multiples of 4"
#endif
#if (VA && (A_T ? TM % 4 : TK % 4)) || (VB && (B_T ? TK % 4 : TN % 4))
#error "VA / VB need the tile's extent along the operand's contiguous dimension to be a multiple of 4"
#endif

#define RTM (TM / WPTM)
#define RTN (TN / WPTN)
#define NTHR (RTM * RTN)
#if VEC
// keeps every local row 16-byte aligned for float4 reads; with rows TM + 4 floats apart (TM % 32 == 0), the
// transposing stores of a float4 read along K land on distinct banks
#define PAD 4
#define ROWM(i) ((((i) >> 2) * RTM + tidm) * 4 + ((i) & 3))
#define COLN(j) ((((j) >> 2) * RTN + tidn) * 4 + ((j) & 3))
#else
#define PAD 1
#define ROWM(i) (tidm + (i) * RTM)
#define COLN(j) (tidn + (j) * RTN)
#endif
#define AS(k, m) As[(k) * (TM + PAD) + (m)]
#define BS(k, n) Bs[(k) * (TN + PAD) + (n)]
#define LD4(p) (*(__global const float4*)(p))
#define ST4(p, v) (*(__local float4*)(p) = (v))

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

    // float4 storage: 16-byte alignment for the VEC reads
    __local float4 As4[(TK * (TM + PAD) + 3) / 4];
    __local float4 Bs4[(TK * (TN + PAD) + 3) / 4];
    __local float* As = (__local float*)As4;
    __local float* Bs = (__local float*)Bs4;

    float acc[WPTM][WPTN];
    for (int i = 0; i < WPTM; i++)
        for (int j = 0; j < WPTN; j++) acc[i][j] = 0.0f;

    int kbeg = 0, kend = K;
    if (causal == 1) kend = min(K, m0 + TM);
    if (causal == 3) kbeg = (m0 / TK) * TK;
    const int tid = tidm * RTN + tidn;

#if PREF
    // register prefetch: the next K slice is read from global memory while the current one is multiplied
#if VA
#define LA ((TM * TK / 4 + NTHR - 1) / NTHR)
    float4 pa[LA];
#if A_T
#define A_MK(g) const int mm = ((g) % (TM / 4)) * 4, kk = (g) / (TM / 4);
#else
#define A_MK(g) const int kk = ((g) % (TK / 4)) * 4, mm = (g) / (TK / 4);
#endif
#define FETCH_A(kt)                                                                        \
    for (int r = 0; r < LA; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        A_MK(g)                                                                            \
        const int gm = m0 + mm, gk = (kt) + kk;                                            \
        pa[r] = (g < TM * TK / 4 && gm < M && gk < kend) ? LD4(A + AIDX(gm, gk)) : (float4)(0.0f); \
    }
#if A_T
#define STORE_A                                                                            \
    for (int r = 0; r < LA; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        A_MK(g)                                                                            \
        if (g < TM * TK / 4) ST4(&AS(kk, mm), pa[r]);                                      \
    }
#else
#define STORE_A                                                                            \
    for (int r = 0; r < LA; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        A_MK(g)                                                                            \
        if (g < TM * TK / 4) {                                                             \
            AS(kk, mm) = pa[r].x; AS(kk + 1, mm) = pa[r].y;                                \
            AS(kk + 2, mm) = pa[r].z; AS(kk + 3, mm) = pa[r].w;                            \
        }                                                                                  \
    }
#endif
#else
#define LA ((TM * TK + NTHR - 1) / NTHR)
    float pa[LA];
#define A_MK(i) const int mm = A_T ? (i) % TM : (i) / TK, kk = A_T ? (i) / TM : (i) % TK;
#define FETCH_A(kt)                                                                        \
    for (int r = 0; r < LA; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        A_MK(i)                                                                            \
        const int gm = m0 + mm, gk = (kt) + kk;                                            \
        pa[r] = (i < TM * TK && gm < M && gk < kend) ? A[AIDX(gm, gk)] : 0.0f;             \
    }
#define STORE_A                                                                            \
    for (int r = 0; r < LA; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        A_MK(i)                                                                            \
        if (i < TM * TK) AS(kk, mm) = pa[r];                                               \
    }
#endif
#if VB
#define LB ((TN * TK / 4 + NTHR - 1) / NTHR)
    float4 pb[LB];
#if B_T
#define B_NK(g) const int kk = ((g) % (TK / 4)) * 4, nn = (g) / (TK / 4);
#else
#define B_NK(g) const int nn = ((g) % (TN / 4)) * 4, kk = (g) / (TN / 4);
#endif
#define FETCH_B(kt)                                                                        \
    for (int r = 0; r < LB; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        B_NK(g)                                                                            \
        const int gn = n0 + nn, gk = (kt) + kk;                                            \
        pb[r] = (g < TN * TK / 4 && gn < N && gk < kend) ? LD4(B + BIDX(gk, gn)) : (float4)(0.0f); \
    }
#if B_T
#define STORE_B                                                                            \
    for (int r = 0; r < LB; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        B_NK(g)                                                                            \
        if (g < TN * TK / 4) {                                                             \
            BS(kk, nn) = pb[r].x; BS(kk + 1, nn) = pb[r].y;                                \
            BS(kk + 2, nn) = pb[r].z; BS(kk + 3, nn) = pb[r].w;                            \
        }                                                                                  \
    }
#else
#define STORE_B                                                                            \
    for (int r = 0; r < LB; r++) {                                                         \
        const int g = tid + r * NTHR;                                                      \
        B_NK(g)                                                                            \
        if (g < TN * TK / 4) ST4(&BS(kk, nn), pb[r]);                                      \
    }
#endif
#else
#define LB ((TN * TK + NTHR - 1) / NTHR)
    float pb[LB];
#define B_NK(i) const int nn = B_T ? (i) / TK : (i) % TN, kk = B_T ? (i) % TK : (i) / TN;
#define FETCH_B(kt)                                                                        \
    for (int r = 0; r < LB; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        B_NK(i)                                                                            \
        const int gn = n0 + nn, gk = (kt) + kk;                                            \
        pb[r] = (i < TN * TK && gn < N && gk < kend) ? B[BIDX(gk, gn)] : 0.0f;             \
    }
#define STORE_B                                                                            \
    for (int r = 0; r < LB; r++) {                                                         \
        const int i = tid + r * NTHR;                                                      \
        B_NK(i)                                                                            \
        if (i < TN * TK) BS(kk, nn) = pb[r];                                               \
    }
#endif
    if (kbeg < kend) { FETCH_A(kbeg) FETCH_B(kbeg) }
#endif
    for (int kt = kbeg; kt < kend; kt += TK) {
#if PREF
        STORE_A
        STORE_B
        barrier(CLK_LOCAL_MEM_FENCE);
        if (kt + TK < kend) { FETCH_A(kt + TK) FETCH_B(kt + TK) }
#else
        for (int i = tid; i < TM * TK; i += NTHR) {
#if A_T
            const int mm = i % TM, kk = i / TM;
#else
            const int kk = i % TK, mm = i / TK;
#endif
            const int gm = m0 + mm, gk = kt + kk;
            AS(kk, mm) = (gm < M && gk < kend) ? A[AIDX(gm, gk)] : 0.0f;
        }
        for (int i = tid; i < TN * TK; i += NTHR) {
#if B_T
            const int kk = i % TK, nn = i / TK;
#else
            const int nn = i % TN, kk = i / TN;
#endif
            const int gn = n0 + nn, gk = kt + kk;
            BS(kk, nn) = (gn < N && gk < kend) ? B[BIDX(gk, gn)] : 0.0f;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
#endif
#pragma unroll
        for (int kk = 0; kk < TK; kk++) {
            float ra[WPTM], rb[WPTN];
#if VEC
#pragma unroll
            for (int c = 0; c < WPTM / 4; c++) {
                const float4 v = *(__local const float4*)&AS(kk, (c * RTM + tidm) * 4);
                ra[4 * c] = v.x; ra[4 * c + 1] = v.y; ra[4 * c + 2] = v.z; ra[4 * c + 3] = v.w;
            }
#pragma unroll
            for (int c = 0; c < WPTN / 4; c++) {
                const float4 v = *(__local const float4*)&BS(kk, (c * RTN + tidn) * 4);
                rb[4 * c] = v.x; rb[4 * c + 1] = v.y; rb[4 * c + 2] = v.z; rb[4 * c + 3] = v.w;
            }
#else
#pragma unroll
            for (int i = 0; i < WPTM; i++) ra[i] = AS(kk, ROWM(i));
#pragma unroll
            for (int j = 0; j < WPTN; j++) rb[j] = BS(kk, COLN(j));
#endif
#pragma unroll
            for (int i = 0; i < WPTM; i++)
#pragma unroll
                for (int j = 0; j < WPTN; j++) acc[i][j] = mad(ra[i], rb[j], acc[i][j]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    for (int i = 0; i < WPTM; i++) {
        const int m = m0 + ROWM(i);
        if (m >= M) continue;
        for (int j = 0; j < WPTN; j++) {
            const int n = n0 + COLN(j);
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
