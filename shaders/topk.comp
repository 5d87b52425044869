#version 460
// Softmax over E router logits and the top k, one workgroup (CPU: coli/models/blocks.py softmax_topk):
//   p = exp(l - max l) / sum exp(l - max l); ids = the k largest p in decreasing order, ties to the lower id
//   (NaN last: NumPy's argsort(-p, kind="stable")[:k]); weights p[ids], or p[ids] / sum p[ids] (flags bit0).
// a0 logits f32 [R, E], a1 route uint [R, 2k] (a row's ids [k], then the weights' float bits [k])
// u0 E (<= 512), u1 k (<= 32), u2 flags: bit0 renormalise the k weights to sum 1; bit 1 gpt-oss's rule instead
// (coli/models/gptoss.py topk_softmax): the top k of the logits themselves (the same order and ties), weights the
// softmax over the k chosen logits; bit 2 the DeepSeek rule (coli/models/blocks.py deepseek_route): scores p the
// softmax, or with bit 3 the sigmoid, of the logits; the choice on c = p + bias (bit 4: a2 bias f32 [E], the
// correction bias), with u3 groups > 1 the experts in u3 contiguous groups, the u4 best by their score (u5 0: the
// group's best c, 1: the sum of its two best) kept and the others' c = -inf (groups ranked as experts are: value,
// then id); weights p[ids], renormalised by sum + 1e-20 with bit 0, times u6 (float bits: the routed scaling factor).
// DeepSeek-V4's rules (coli/models/deepseek4.py MoE.route_tokens), with bit 2: bit 5 the scores p = sqrt(softplus(l))
// (sqrtsoftplus: softplus as max(l, 0) + log1p(exp(-|l|)), log1p by its atanh series, no log near 1); bit 6 the
// hash rule: the ids are row tok of a3 tid2eid int32 [vocab, k] (ffn_gate_tid2eid), tok = a4 tokens uint [R] at the
// row, no ranking; weights p[ids] as above.
// groups: (R, 1, 1), one a row.
// Every p is ranked by counting the p that come before it (a strict total order: value, then id), so ids need
// no sort and no iterative argmax; an invocation stops counting once k come before its expert. The renormalising
// sum follows NumPy's (pairwise_sum of up to 128 floats: in order below 8, else 8 running sums), so with equal p
// the weights are equal bit for bit. With k > E only the first E ranks are written.
#extension GL_GOOGLE_include_directive : require
#include "layer_common.glsl"

layout(local_size_x_id = 0) in;
#include "layer_reduce.glsl"
#define TOPK_L F32
#include "topk_row.glsl"

void main() {
    topk_row(gl_WorkGroupID.x, uint64_t[5](pc.a[0], pc.a[1], pc.a[2], pc.a[3], pc.a[4]),
             uint[7](pc.u[0], pc.u[1], pc.u[2], pc.u[3], pc.u[4], pc.u[5], pc.u[6]));
}
