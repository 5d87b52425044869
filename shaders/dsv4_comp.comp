#version 460
// DeepSeek-V4's compressors (CPU: coli/models/deepseek4.py Compressor.update, cpu_kernels/dsv4.py compress; HF
// DeepseekV4HCACompressor / CSACompressor / the indexer's). A call's T rows at positions pos0 .. pos0 + T - 1 close
// the windows w of m rows (positions w m .. w m + m - 1) whose last position is among them; entry w is, per dim d,
//   c_d = sum_rows softmax_rows(gate + ape)_d kv_d
// over the window's own rows (columns ow .. ow + hd of kv and gate, ape row i = the row's place in the window;
// ow = hd with overlap (CSA: rows 2 hd wide), else 0) and, with overlap and w > 0, first the previous window's rows
// (columns 0 .. hd, ape's too); then RMSNorm(c) * norm and rope on the last 2 R2 dims at position w m.
// Rows before pos0 come from the ring of the last RR rows (RR = 2 m with overlap, else m; position P at row P % RR).
// mode 0 (u7), one workgroup a window, groups (ceil(T / m) + 1, 1, 1) (those past the call's last window return):
//   a0 kv f32 [T, width] this call's rows, a1 gate f32 [T, width], a2 ring f32 [RR, 2, width] (kv row, gate row),
//   a3 params uint [..] (pos0 = params[0]), a4 ape f32 [m, width], a5 norm f32 [hd], a6 rope table f32 [2, ctx, R2]
//   (cos rows, then sin rows), a7 entries f32 [ctx / m, hd] (entry w written)
//   u0 hd (<= MAXD), u1 m, u2 overlap (0 / 1), u3 eps (bits), u4 R2, u5 ctx, u6 T
// mode 1, after mode 0, groups (ceil(2 width / WG), T, 1): the ring write of the call's last min(T, RR) rows.
// An invocation a dim: the max of gate + ape over the rows, then the sum of exp and of exp * kv (f32; the CPU's
// online softmax is f64), the RMS as a workgroup sum.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

#define MAXD 512u
shared float CS[MAXD];

void main() {
    uint hd = pc.u[0], m = pc.u[1], ov = pc.u[2], T = pc.u[6];
    uint width = ov != 0u ? 2u * hd : hd, RR = ov != 0u ? 2u * m : m;
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    U32 PAR = U32(pc.a[3]);
    uint pos0 = PAR.v[0];
    F32 KV = F32(pc.a[0]);
    F32 GT = F32(pc.a[1]);
    F32 RING = F32(pc.a[2]);
    if (pc.u[7] == 1u) {                            // the ring write
        uint r = gl_WorkGroupID.y, c = gl_WorkGroupID.x * WG + t;
        if (c >= 2u * width || r + RR < T) return;
        F32 SRC = c < width ? KV : GT;
        RING.v[((pos0 + r) % RR) * 2u * width + c] = SRC.v[r * width + c % width];
        return;
    }
    uint R2 = pc.u[4], ctx = pc.u[5];
    uint wfirst = (pos0 + 1u + m - 1u) / m - 1u;    // ceil((pos0 + 1) / m) - 1: the first window closing here
    uint w = wfirst + gl_WorkGroupID.x;
    if ((w + 1u) * m > pos0 + T) return;            // not closed by this call (uniform over the workgroup)
    F32 APE = F32(pc.a[4]);
    F32 NRM = F32(pc.a[5]);
    F32 ROPE = F32(pc.a[6]);
    F32 ENT = F32(pc.a[7]);
    bool prev = ov != 0u && w > 0u;
    uint p0 = prev ? (w - 1u) * m : w * m;          // first pooled position
    uint nr = prev ? 2u * m : m;
    float ss = 0.0;
    for (uint d = t; d < hd; d += WG) {
        float mx = -1.0 / 0.0;
        for (uint i = 0u; i < nr; i++) {
            uint P = p0 + i, col = (prev && i < m) ? d : (ov != 0u ? hd + d : d), ai = i % m;
            float g = (P >= pos0 ? GT.v[(P - pos0) * width + col] : RING.v[((P % RR) * 2u + 1u) * width + col])
                      + APE.v[ai * width + col];
            mx = max(mx, g);
        }
        float tot = 0.0, acc = 0.0;
        for (uint i = 0u; i < nr; i++) {
            uint P = p0 + i, col = (prev && i < m) ? d : (ov != 0u ? hd + d : d), ai = i % m;
            bool here = P >= pos0;
            float g = (here ? GT.v[(P - pos0) * width + col] : RING.v[((P % RR) * 2u + 1u) * width + col])
                      + APE.v[ai * width + col];
            float v = here ? KV.v[(P - pos0) * width + col] : RING.v[(P % RR) * 2u * width + col];
            float e = exp(g - mx);
            tot += e;
            acc += e * v;
        }
        float c = acc / tot;
        CS[d] = c;
        ss += c * c;
    }
    ss = wg_sum(ss);                                // its barriers order the CS writes before the reads below
    float inv = 1.0 / sqrt(ss / float(hd) + pcf(3u));
    uint rb = hd - 2u * R2, p = w * m;
    for (uint d = t; d < hd; d += WG) {
        float o = (CS[d] * inv) * NRM.v[d];
        if (d >= rb) {                              // rope at the window's first position: (a c - b s, b c + a s)
            uint i = (d - rb) >> 1;
            float c = ROPE.v[p * R2 + i], sn = ROPE.v[(ctx + p) * R2 + i];
            float a = (CS[rb + 2u * i] * inv) * NRM.v[rb + 2u * i];
            float b = (CS[rb + 2u * i + 1u] * inv) * NRM.v[rb + 2u * i + 1u];
            o = ((d - rb) & 1u) == 0u ? a * c - b * sn : b * c + a * sn;
        }
        ENT.v[w * hd + d] = o;
    }
}
