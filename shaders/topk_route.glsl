// The router's softmax top-k in one workgroup (topk.comp; lmoe.comp mode 1 with its route flag makes the
// route itself, one dispatch less): topk_route(logits, E, k, renorm) leaves the ids in SID[0..min(k, E)) and
// their weights (renormalised when asked) in SW, the same for every invocation. Needs layer_reduce.glsl and
// uniform control flow (barriers). See topk.comp for the rule.
#define MAXE 512u
#define TOPK_MAXK 32u
shared float P[MAXE];
shared uint SID[TOPK_MAXK];
shared float SW[TOPK_MAXK];

// a (expert ia) comes before b (expert ib): larger first, ties to the lower id, NaN after every number
bool before(float a, uint ia, float b, uint ib) {
    if (isnan(a)) return isnan(b) && ia < ib;
    if (isnan(b)) return true;
    return a > b || (a == b && ia < ib);
}

void topk_route(F32 L, uint E, uint K, bool renorm) {
    E = min(E, MAXE);
    K = min(K, TOPK_MAXK);
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
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
        P[e] = p;
        s += p;
    }
    s = wg_sum(s);
    for (uint e = t; e < E; e += WG) P[e] = P[e] / s;
    barrier();
    uint kk = min(K, E);
    for (uint e = t; e < E; e += WG) {
        float pe = P[e];
        uint rank = 0u;
        for (uint f = 0u; f < E && rank < kk; f++)
            if (before(P[f], f, pe, e)) rank++;
        if (rank < kk) {
            SID[rank] = e;
            SW[rank] = pe;
        }
    }
    barrier();
    if (t == 0u && renorm) {
        precise float tot;
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
        for (uint j = 0u; j < kk; j++) SW[j] = SW[j] / tot;
    }
    barrier();
}
