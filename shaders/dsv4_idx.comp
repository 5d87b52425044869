#version 460
// DeepSeek-V4's lightning indexer (CPU: cpu_kernels/dsv4.py indexer_topk; HF DeepseekV4Indexer): for a query row at
// position p = pos0 + t the visible entries are j < nv = min((p + 1) / m, n_ent) of the indexer compressor's, scored
//   sc[t, j] = sum_h w[t, h] ReLU(scale iq[t, h] . ik[j])   (w already times Hi^-1/2; scale = Di^-1/2)
// and the K best kept (ties to the earlier entry), or every visible entry then -1 while nv <= K.
// Common: a3 params uint [..] (pos0 = params[0]), u0 Hi, u1 Di, u2 m, u3 n_ent, u4 K, u5 scale (bits), u6 ldS (floats
// of a score row, >= n_ent).
// mode 0 (u7, scores), groups (ceil(n_ent / WG), T, 1): a0 iq f32 [T, Hi, Di] (roped), a1 ik f32 [n_ent, Di] (roped),
//   a2 w f32 [T, Hi] (times u8's float when u8 > 0: Hi^-1/2, as the CPU scales indexer.proj's output), a4 S f32
//   [T, ldS]: an invocation an entry, in the CPU's order (h, then d); rows with nv <= K skip.
// mode 1 (top-k), groups (T, 1, 1): a4 S, a5 SEL int [T, K]: the K-th best score by a radix select over the scores'
//   order-preserving bits (32 counting passes), then one pass writing the entries above it and the first ones equal
//   to it, in entry order (the CPU's set, any order there).
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

shared uint JS[gl_WorkGroupSize.x];
shared uint QC[gl_WorkGroupSize.x];

// a score's bits in an order that compares as the floats do (-0 as +0)
uint okey(float x) {
    uint u = floatBitsToUint(x == 0.0 ? 0.0 : x);
    return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

void main() {
    uint Hi = pc.u[0], Di = pc.u[1], m = pc.u[2], nent = pc.u[3], KT = pc.u[4], ldS = pc.u[6];
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint pos0 = U32(pc.a[3]).v[0];
    F32 S = F32(pc.a[4]);
    if (pc.u[7] == 0u) {
        uint row = gl_WorkGroupID.y, j = gl_WorkGroupID.x * WG + t;
        uint nv = min((pos0 + row + 1u) / m, nent);
        if (j >= nv || nv <= KT) return;
        F32 Q = F32(pc.a[0]);
        F32 IK = F32(pc.a[1]);
        F32 WH = F32(pc.a[2]);
        float scale = pcf(5u), hs = pc.u[8] != 0u ? pcf(8u) : 1.0;
        uint qb = row * Hi * Di, kb = j * Di;
        float tot = 0.0;
        for (uint h = 0u; h < Hi; h++) {
            float s = 0.0;
            for (uint d = 0u; d < Di; d++) s += Q.v[qb + h * Di + d] * IK.v[kb + d];
            s *= scale;
            if (s > 0.0) tot += (WH.v[row * Hi + h] * hs) * s;
        }
        S.v[row * ldS + j] = tot;
        return;
    }
    uint row = gl_WorkGroupID.x;
    uint n = min((pos0 + row + 1u) / m, nent);
    U32 SEL = U32(pc.a[5]);
    uint sb = row * KT;
    if (n <= KT) {
        for (uint j = t; j < KT; j += WG) SEL.v[sb + j] = j < n ? j : 0xFFFFFFFFu;
        return;
    }
    uint per = (n + WG - 1u) / WG, a = min(t * per, n), e = min(a + per, n);
    uint prefix = 0u, want = KT;
    for (int b = 31; b >= 0; b--) {
        uint cand = prefix | (1u << uint(b)), hm = ~((1u << uint(b)) - 1u);
        uint c = 0u;
        for (uint j = a; j < e; j++) c += (okey(S.v[row * ldS + j]) & hm) == cand ? 1u : 0u;
        uint tot = uint(wg_sum(float(c)));     // exact: counts below 2^24
        if (tot >= want) prefix = cand; else want -= tot;
    }
    // prefix: the K-th best score's key; want: how many entries equal to it are taken (the earliest)
    uint g = 0u, q = 0u;
    for (uint j = a; j < e; j++) {
        uint k = okey(S.v[row * ldS + j]);
        g += k > prefix ? 1u : 0u;
        q += k == prefix ? 1u : 0u;
    }
    JS[t] = g;
    QC[t] = q;
    barrier();
    uint gb = 0u, qb = 0u;
    for (uint i = 0u; i < t; i++) {
        gb += JS[i];
        qb += QC[i];
    }
    for (uint j = a; j < e; j++) {
        uint k = okey(S.v[row * ldS + j]);
        bool take = k > prefix || (k == prefix && qb < want);
        if (take) SEL.v[sb + gb + min(qb, want)] = j;
        gb += k > prefix ? 1u : 0u;
        qb += k == prefix ? 1u : 0u;
    }
}
