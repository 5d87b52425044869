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

#define MAXE 512u
#define MAXK 32u
shared float P[MAXE];
#define MAXG 64u
shared float C[MAXE];      // the DeepSeek rule's choice scores
shared float GS[MAXG];     // and its groups' scores
shared bool GK[MAXG];      // kept groups
shared uint SID[MAXK];
shared float SW[MAXK];

// log(1 + y) for 0 <= y <= 1: 2 atanh(z), z = y / (2 + y) <= 1/3, by its series to z^23 (error below 1e-12 relative;
// GLSL's log near 1 has an absolute error bound only)
float log1p_01(float y) {
    float z = y / (2.0 + y), z2 = z * z, a = 1.0 / 23.0;
    for (int n = 21; n >= 1; n -= 2) a = a * z2 + 1.0 / float(n);
    return 2.0 * z * a;
}

// sqrt(softplus(x)) (deepseek4.sqrtsoftplus)
float sqrt_softplus(float x) {
    return sqrt(max(x, 0.0) + log1p_01(exp(-abs(x))));
}

// a (expert ia) comes before b (expert ib): larger first, ties to the lower id, NaN after every number
bool before(float a, uint ia, float b, uint ib) {
    if (isnan(a)) return isnan(b) && ia < ib;
    if (isnan(b)) return true;
    return a > b || (a == b && ia < ib);
}

void main() {
    uint E = min(pc.u[0], MAXE), K = min(pc.u[1], MAXK);
    bool tks = (pc.u[2] & 2u) != 0u;
    bool renorm = tks || (pc.u[2] & 1u) != 0u;
    bool ds = (pc.u[2] & 4u) != 0u, sig = ds && (pc.u[2] & 8u) != 0u;
    bool ssp = ds && (pc.u[2] & 32u) != 0u, hash = ds && (pc.u[2] & 64u) != 0u;
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    uint row = gl_WorkGroupID.x;
    F32 L = F32(pc.a[0] + uint64_t(4u * row * pc.u[0]));
    U32 R = U32(pc.a[1] + uint64_t(8u * row * pc.u[1]));
    float m = -1.0 / 0.0;
    bool nan_seen = false;
    for (uint e = t; e < E; e += WG) {
        float v = L.v[e];
        P[e] = v;
        m = max(m, v);
        nan_seen = nan_seen || isnan(v);
    }
    m = wg_max(m);
    // NumPy's max is NaN when a logit is: every p is NaN then
    if (wg_max(nan_seen ? 1.0 : 0.0) > 0.0) m = uintBitsToFloat(0x7fc00000u);
    float s = 0.0;
    for (uint e = t; e < E; e += WG) {
        float p = exp(P[e] - m);
        if (!tks) P[e] = p;          // (top-k softmax: the logits are ranked)
        s += p;
    }
    s = wg_sum(s);
    if (!tks) {
        for (uint e = t; e < E; e += WG)
            P[e] = ssp ? sqrt_softplus(L.v[e]) : sig ? 1.0 / (1.0 + exp(-L.v[e])) : P[e] / s;
    }
    if (ds) {                        // the choice scores, then the groups that keep their experts
        bool hasb = (pc.u[2] & 16u) != 0u;
        for (uint e = t; e < E; e += WG) C[e] = hasb ? P[e] + F32(pc.a[2]).v[e] : P[e];
        uint ng = min(max(pc.u[3], 1u), MAXG), gsz = E / ng;
        barrier();
        if (ng > 1u) {
            for (uint g = t; g < ng; g += WG) {
                float b1 = -1.0 / 0.0, b2 = -1.0 / 0.0;      // the group's best and second best
                for (uint i = 0u; i < gsz; i++) {
                    float v = C[g * gsz + i];
                    if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
                }
                GS[g] = (pc.u[5] == 1u && gsz > 1u) ? b2 + b1 : b1;
            }
            barrier();
            for (uint g = t; g < ng; g += WG) {
                uint rank = 0u;
                for (uint f = 0u; f < ng; f++)
                    if (before(GS[f], f, GS[g], g)) rank++;
                GK[g] = rank < pc.u[4];
            }
            barrier();
            for (uint e = t; e < E; e += WG)
                if (!GK[e / gsz]) C[e] = -1.0 / 0.0;
        }
    }
    barrier();
    uint kk = min(K, E);
    if (hash) {                      // the token's experts from the table, no ranking
        uint tok = U32(pc.a[4]).v[row];
        for (uint j = t; j < kk; j += WG) {
            uint e = U32(pc.a[3]).v[tok * pc.u[1] + j];
            SID[j] = e;
            SW[j] = P[min(e, E - 1u)];
        }
    }
    for (uint e = t; e < E && !hash; e += WG) {
        float pe = ds ? C[e] : P[e];
        uint rank = 0u;
        if (ds) {
            for (uint f = 0u; f < E && rank < kk; f++)
                if (before(C[f], f, pe, e)) rank++;
        } else {
            for (uint f = 0u; f < E && rank < kk; f++)
                if (before(P[f], f, pe, e)) rank++;
        }
        if (rank < kk) {
            SID[rank] = e;
            SW[rank] = P[e];
        }
    }
    barrier();
    if (t == 0u) {
        if (tks) {   // exp(v - the largest chosen), renormalised below: the softmax over the k chosen
            float mx = SW[0];
            for (uint j = 0u; j < kk; j++) SW[j] = exp(SW[j] - mx);
        }
        precise float tot = 1.0;
        if (renorm) {
            if (kk < 8u) {
                tot = 0.0;
                for (uint j = 0u; j < kk; j++) tot += SW[j];
            } else {
                precise float r[8];
                for (uint q = 0u; q < 8u; q++) r[q] = SW[q];
                uint n8 = kk - kk % 8u, i = 8u;
                for (; i < n8; i += 8u)
                    for (uint q = 0u; q < 8u; q++) r[q] += SW[i + q];
                tot = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
                for (; i < kk; i++) tot += SW[i];
            }
        }
        for (uint j = 0u; j < kk; j++) {
            R.v[j] = SID[j];
            float w = renorm ? SW[j] / (ds ? tot + 1e-20 : tot) : SW[j];
            R.v[pc.u[1] + j] = floatBitsToUint(ds ? w * pcf(6u) : w);
        }
    }
}
