#version 460
// RMSNorm of R rows of D, one workgroup per row (coli/vulkan/layers.py; CPU: cpu_kernels/norms.py rms_norm):
//   out[r, i] = x[r, i] * (1 / sqrt(mean_i(x[r, :]^2) + eps)) * w[i]
// a0 x f32 [R, D], a1 w f32 [D], a2 out f32 [R, D] (may be a0: in place; each invocation reads the elements it
// writes, after the reduction)
// u0 D, u1 eps (float bits), u2 nper, u3 stride: with nper > 0 row r starts at (r / nper) * stride + (r % nper) * D
// (q/k heads inside rows of qkv), else at r * D; u4 bit 0: out[r, i] += the normed value (Gemma 3's post-attention
// and post-FFN norms into the residual; a2 other than a0). groups: (R, 1, 1).
// The sum of squares is f32 (the CPU's is f64): per-invocation running sums, then the workgroup sum.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"

void main() {
    uint D = pc.u[0];
    float eps = pcf(1u);
    uint r = gl_WorkGroupID.x, t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    F32 X = F32(pc.a[0]);
    F32 W = F32(pc.a[1]);
    F32 Y = F32(pc.a[2]);
    uint nper = pc.u[2];
    uint base = nper == 0u ? r * D : (r / nper) * pc.u[3] + (r % nper) * D;
    float s = 0.0;
    for (uint i = t; i < D; i += WG) {
        float v = X.v[base + i];
        s += v * v;
    }
    s = wg_sum(s);
    float inv = 1.0 / sqrt(s / float(D) + eps);
    if ((pc.u[4] & 1u) != 0u) {
        for (uint i = t; i < D; i += WG) Y.v[base + i] += (X.v[base + i] * inv) * W.v[i];
    } else {
        for (uint i = t; i < D; i += WG) Y.v[base + i] = (X.v[base + i] * inv) * W.v[i];
    }
}
