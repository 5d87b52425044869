#version 460
// Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention) and the attention output gate, for R rows in order
// (CPU: coli/models/deltanet.py, cpu_kernels/deltanet.py; docs/vulkan.md "Device layers"). Three modes (u0); the
// projections (attn_qkv, attn_gate, ssm_ba or ssm_beta / ssm_alpha) and ssm_out are lmv.comp dispatches.
//  mode 0 (conv), groups (ceil(C / WG), 1, 1): a0 x f32 [R, C] (attn_qkv's rows), a1 w f32 [C, K] (ssm_conv1d),
//    a2 state f32 [K - 1, C] (the last K - 1 input rows, rolled in place), a3 out f32 [R, C]:
//    out[t, c] = silu(sum_j w[c, j] x[t + j - (K - 1), c]), rows before 0 read from the state. u1 C, u2 K, u3 R.
//  mode 1 (delta rule), groups (Hv, 1, 1): a0 the conv rows f32 [R, C] (q heads, k heads, v heads), a1 z f32
//    [R, Hv dv] (attn_gate), a2 ba f32 [R, 2 Hv] (raw beta and alpha: flag bit 1 Qwen3-Next's ssm_ba order, per key
//    head Hv / Hk beta then Hv / Hk alpha; else beta [0, Hv), alpha [Hv, 2 Hv)), a3 state f32 [Hv, dk, dv], a4 ssm_a
//    f32 [Hv], a5 dt bias f32 [Hv], a6 ssm_norm f32 [dv], a7 out f32 [R, Hv dv]. u1 Hk, u2 Hv, u3 dk, u4 dv, u5 R,
//    u6 eps (float bits), u7 flags (bit 0: tiled value heads, head h reads key head h % Hk; else h / (Hv / Hk)).
//    Per row: q, k l2-normed (x / sqrt(sum x^2 + 1e-6)), q / sqrt(dk); beta = sigmoid(b); g = ssm_a softplus(a + dt);
//    S *= exp(g); kv = S^T k; S += k (x) (v - kv) beta; o = S^T q; out = rmsnorm(o) * w * silu(z). Invocation j
//    owns state columns j, j + WG, ... (dk <= MAXK).
//    Flag bit 2, KDA (Kimi-Linear; CPU: coli/models/kimi.py, cpu_kernels/kda.py; Hk = Hv, dk = dv): a2's rows are
//    Hv raw betas then the Hv dk decay inputs f (ssm_f_b's rows), a5 the dt bias f32 [Hv dk] per channel: the decay
//    is one a key channel, exp(ssm_a softplus(f_i + dt_i)); a1 the gate rows (ssm_g_b's): out = rmsnorm(o) * w *
//    sigmoid(gate).
//  mode 4 (delta rule, the state in registers: a prompt chunk), mode 1's groups, addresses and words: the same
//    rows in order, but invocation t owns state column j = t % dv, rows i = p + P s of it (p = t / dv, P = WG / dv)
//    in registers from the chunk's first row to its last (read and written once a chunk, not twice a row); the
//    partial sums of S^T k and S^T q joined in part order through shared memory. Needs dv <= WG and
//    dk <= MAXS P (coli/vulkan/layer_families.py DeltaNetMixer._dn_rec_mode).
//  mode 2 (gate), groups (ceil(N / WG), R, 1): a0 y f32 [R, N] (the attention output), a1 g f32 with rows of u2
//    floats: y[t, i] *= sigmoid(g[t * u2 + u3 + i]) (Qwen3-Next's gated attention). u1 N, u2 row stride, u3 offset.
//  mode 3 (low rank), groups (ceil(O / WG), R, 1): a0 x f32 rows of u3 floats, a1 W f32 [O, I], a2 y f32 rows of u4
//    floats: y[t, o] = sum_i W[o, i] x[t, i], any I (KDA's ssm_f_b and ssm_g_b, held as f32). u1 O, u2 I.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXK 256u
#define MAXS 64u     // state rows an invocation holds in mode 4
shared float QS[MAXK];
shared float KS[MAXK];
shared float DS[MAXK];
shared float PS[gl_WorkGroupSize.x];

float sigm(float x) {
    float e = exp(-abs(x));
    return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

void main() {
    uint mode = pc.u[0], t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    if (mode == 0u) {
        uint C = pc.u[1], K = pc.u[2], R = pc.u[3];
        uint c = gl_WorkGroupID.x * WG + t;
        if (c >= C) return;
        F32 X = F32(pc.a[0]);
        F32 W = F32(pc.a[1]);
        F32 S = F32(pc.a[2]);
        F32 O = F32(pc.a[3]);
        for (uint r = 0u; r < R; r++) {
            float s = 0.0;
            for (uint j = 0u; j < K; j++) {
                int src = int(r + j) - int(K - 1u);     // < 0: the state's rows
                float x = src >= 0 ? X.v[uint(src) * C + c] : S.v[uint(int(K - 1u) + src) * C + c];
                s += W.v[c * K + j] * x;
            }
            O.v[r * C + c] = s * sigm(s);
        }
        // roll the state to the last K - 1 rows of [state; x] (ascending: row i reads row i + R of the old state)
        for (uint i = 0u; i + 1u < K; i++) {
            int src = int(R) - int(K - 1u) + int(i);
            S.v[i * C + c] = src >= 0 ? X.v[uint(src) * C + c] : S.v[(i + R) * C + c];
        }
        return;
    }
    if (mode == 3u) {
        uint O = pc.u[1], I = pc.u[2], ldx = pc.u[3], ldy = pc.u[4];
        uint o = gl_WorkGroupID.x * WG + t, r = gl_WorkGroupID.y;
        if (o >= O) return;
        F32 X = F32(pc.a[0]);
        F32 W = F32(pc.a[1]);
        F32 Y = F32(pc.a[2]);
        float s = 0.0;
        for (uint i = 0u; i < I; i++) s += W.v[o * I + i] * X.v[r * ldx + i];
        Y.v[r * ldy + o] = s;
        return;
    }
    if (mode == 2u) {
        uint N = pc.u[1], ld = pc.u[2], off = pc.u[3];
        uint i = gl_WorkGroupID.x * WG + t, r = gl_WorkGroupID.y;
        if (i >= N) return;
        F32 Y = F32(pc.a[0]);
        F32 G = F32(pc.a[1]);
        Y.v[r * N + i] *= sigm(G.v[r * ld + off + i]);
        return;
    }
    uint Hk = pc.u[1], Hv = pc.u[2], dk = pc.u[3], dv = pc.u[4], R = pc.u[5], flags = pc.u[7];
    float eps = pcf(6u);
    uint h = gl_WorkGroupID.x, rep = Hv / Hk;
    uint hk = (flags & 1u) != 0u ? h % Hk : h / rep;
    uint C = 2u * Hk * dk + Hv * dv;
    F32 X = F32(pc.a[0]);
    F32 Z = F32(pc.a[1]);
    F32 BA = F32(pc.a[2]);
    F32 S = F32(pc.a[3]);
    F32 A = F32(pc.a[4]);
    F32 DT = F32(pc.a[5]);
    F32 NW = F32(pc.a[6]);
    F32 O = F32(pc.a[7]);
    uint ib = (flags & 2u) != 0u ? hk * 2u * rep + h % rep : h;
    uint ia = (flags & 2u) != 0u ? ib + rep : Hv + h;
    uint s0 = h * dk * dv;
    bool kda = (flags & 4u) != 0u;
    uint ldba = kda ? Hv + Hv * dk : 2u * Hv;
    if (kda) ib = h;
    if (mode == 4u) {
        uint P = WG / dv, j = t % dv, p = t / dv;
        bool on = t < P * dv;
        float st[MAXS];
        [[unroll]] for (uint s = 0u; s < MAXS; s++) {
            uint i = p + P * s;
            st[s] = on && i < dk ? S.v[s0 + i * dv + j] : 0.0;
        }
        for (uint r = 0u; r < R; r++) {
            uint x0 = r * C;
            float sq = 0.0, sk = 0.0;
            for (uint i = t; i < dk; i += WG) {
                float q = X.v[x0 + hk * dk + i], k = X.v[x0 + Hk * dk + hk * dk + i];
                QS[i] = q;
                KS[i] = k;
                sq += q * q;
                sk += k * k;
                if (kda) {
                    float x = BA.v[r * ldba + Hv + h * dk + i] + DT.v[h * dk + i];
                    float sp = x > 20.0 ? x : log(1.0 + exp(x));
                    DS[i] = exp(A.v[h] * sp);
                }
            }
            sq = wg_sum(sq);     // barriers inside: QS / KS / DS are written
            sk = wg_sum(sk);
            float fq = 1.0 / sqrt(float(dk)) / sqrt(sq + 1e-6), fk = 1.0 / sqrt(sk + 1e-6);
            float beta = sigm(BA.v[r * ldba + ib]);
            float dec = 1.0;
            if (!kda) {
                float x = BA.v[r * ldba + ia] + DT.v[h];
                float sp = x > 20.0 ? x : log(1.0 + exp(x));
                dec = exp(A.v[h] * sp);
            }
            float kv = 0.0;
            [[unroll]] for (uint s = 0u; s < MAXS; s++) {
                uint i = p + P * s;
                if (on && i < dk) {
                    float v = st[s] * (kda ? DS[i] : dec);
                    st[s] = v;
                    kv += v * (KS[i] * fk);
                }
            }
            PS[t] = kv;
            barrier();
            float kvt = 0.0;
            for (uint q = 0u; q < P; q++) kvt += PS[q * dv + j];
            float dl = on ? (X.v[x0 + 2u * Hk * dk + h * dv + j] - kvt) * beta : 0.0;
            float o = 0.0;
            [[unroll]] for (uint s = 0u; s < MAXS; s++) {
                uint i = p + P * s;
                if (on && i < dk) {
                    float v = st[s] + (KS[i] * fk) * dl;
                    st[s] = v;
                    o += v * (QS[i] * fq);
                }
            }
            barrier();           // every PS read of S^T k before the o partials
            PS[t] = o;
            barrier();
            float ot = 0.0;
            for (uint q = 0u; q < P; q++) ot += PS[q * dv + j];
            bool lead = on && p == 0u;
            float ss = wg_sum(lead ? ot * ot : 0.0);
            float inv = 1.0 / sqrt(ss / float(dv) + eps);
            if (lead) {
                uint oi = r * Hv * dv + h * dv + j;
                float zz = Z.v[oi];
                O.v[oi] = NW.v[j] * (ot * inv) * (kda ? sigm(zz) : zz * sigm(zz));
            }
            barrier();           // QS / KS / DS / PS of the next row
        }
        [[unroll]] for (uint s = 0u; s < MAXS; s++) {
            uint i = p + P * s;
            if (on && i < dk) S.v[s0 + i * dv + j] = st[s];
        }
        return;
    }
    for (uint r = 0u; r < R; r++) {
        uint x0 = r * C;
        float sq = 0.0, sk = 0.0;
        for (uint i = t; i < dk; i += WG) {
            float q = X.v[x0 + hk * dk + i], k = X.v[x0 + Hk * dk + hk * dk + i];
            QS[i] = q;
            KS[i] = k;
            sq += q * q;
            sk += k * k;
            if (kda) {      // one decay a key channel
                float x = BA.v[r * ldba + Hv + h * dk + i] + DT.v[h * dk + i];
                float sp = x > 20.0 ? x : log(1.0 + exp(x));
                DS[i] = exp(A.v[h] * sp);
            }
        }
        sq = wg_sum(sq);     // barriers inside: QS / KS are written
        sk = wg_sum(sk);
        float fq = 1.0 / sqrt(float(dk)) / sqrt(sq + 1e-6), fk = 1.0 / sqrt(sk + 1e-6);
        float beta = sigm(BA.v[r * ldba + ib]);
        float dec = 1.0;
        if (!kda) {
            float x = BA.v[r * ldba + ia] + DT.v[h];
            float sp = x > 20.0 ? x : log(1.0 + exp(x));
            dec = exp(A.v[h] * sp);
        }
        float ss = 0.0;
        for (uint j = t; j < dv; j += WG) {
            float kv = 0.0;
            for (uint i = 0u; i < dk; i++) {
                float s = S.v[s0 + i * dv + j] * (kda ? DS[i] : dec);
                S.v[s0 + i * dv + j] = s;
                kv += s * (KS[i] * fk);
            }
            float dl = (X.v[x0 + 2u * Hk * dk + h * dv + j] - kv) * beta;
            float o = 0.0;
            for (uint i = 0u; i < dk; i++) {
                float s = S.v[s0 + i * dv + j] + (KS[i] * fk) * dl;
                S.v[s0 + i * dv + j] = s;
                o += s * (QS[i] * fq);
            }
            O.v[r * Hv * dv + h * dv + j] = o;
            ss += o * o;
        }
        ss = wg_sum(ss);
        float inv = 1.0 / sqrt(ss / float(dv) + eps);
        for (uint j = t; j < dv; j += WG) {
            uint oi = r * Hv * dv + h * dv + j;
            float zz = Z.v[oi];
            O.v[oi] = NW.v[j] * (O.v[oi] * inv) * (kda ? sigm(zz) : zz * sigm(zz));
        }
        barrier();      // QS / KS of the next row
    }
}
