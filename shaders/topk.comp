#version 460
// Softmax over E router logits and the top k, one workgroup (CPU: coli/models/blocks.py softmax_topk):
//   p = exp(l - max l) / sum exp(l - max l); ids = the k largest p in decreasing order, ties to the lower id
//   (NaN last: NumPy's argsort(-p, kind="stable")[:k]); weights p[ids], or p[ids] / sum p[ids] (flags bit0).
// a0 logits f32 [E], a1 route uint [2k] (ids [k], then the weights' float bits [k])
// u0 E (<= 512), u1 k (<= 32), u2 flags: bit0 renormalise the k weights to sum 1. groups: (1, 1, 1).
// Every p is ranked by counting the p that come before it (a strict total order: value, then id), so ids need
// no sort and no iterative argmax; an invocation stops counting once k come before its expert. The renormalising
// sum follows NumPy's (pairwise_sum of up to 128 floats: in order below 8, else 8 running sums), so with equal p
// the weights are equal bit for bit. With k > E only the first E ranks are written.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"
#include "topk_route.glsl"

void main() {
    uint K = min(pc.u[1], TOPK_MAXK), kk = min(K, min(pc.u[0], MAXE));
    topk_route(F32(pc.a[0]), pc.u[0], pc.u[1], (pc.u[2] & 1u) != 0u);
    if (gl_LocalInvocationIndex == 0u) {
        U32 R = U32(pc.a[1]);
        for (uint j = 0u; j < kk; j++) {
            R.v[j] = SID[j];
            R.v[pc.u[1] + j] = floatBitsToUint(SW[j]);
        }
    }
}
