// topk.comp's work as a function (topk.comp; lmv.comp's router tail): topk_row(row, ta, tu) with ta / tu the
// addresses a0..a4 and words u0..u6 that topk.comp's header names. Include after layer_reduce.glsl; define
// TOPK_L (the logits' buffer type: F32, or F32C where other workgroups of the dispatch wrote them) first.
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

void topk_row(uint row, uint64_t ta[5], uint tu[7]) {
    uint E = min(tu[0], MAXE), K = min(tu[1], MAXK);
    bool tks = (tu[2] & 2u) != 0u;
    bool renorm = tks || (tu[2] & 1u) != 0u;
    bool ds = (tu[2] & 4u) != 0u, sig = ds && (tu[2] & 8u) != 0u;
    bool ssp = ds && (tu[2] & 32u) != 0u, hash = ds && (tu[2] & 64u) != 0u;
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    TOPK_L L = TOPK_L(ta[0] + uint64_t(4u * row * tu[0]));
    U32 R = U32(ta[1] + uint64_t(8u * row * tu[1]));
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
        bool hasb = (tu[2] & 16u) != 0u;
        for (uint e = t; e < E; e += WG) C[e] = hasb ? P[e] + F32(ta[2]).v[e] : P[e];
        uint ng = min(max(tu[3], 1u), MAXG), gsz = E / ng;
        barrier();
        if (ng > 1u) {
            for (uint g = t; g < ng; g += WG) {
                float b1 = -1.0 / 0.0, b2 = -1.0 / 0.0;      // the group's best and second best
                for (uint i = 0u; i < gsz; i++) {
                    float v = C[g * gsz + i];
                    if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
                }
                GS[g] = (tu[5] == 1u && gsz > 1u) ? b2 + b1 : b1;
            }
            barrier();
            for (uint g = t; g < ng; g += WG) {
                uint rank = 0u;
                for (uint f = 0u; f < ng; f++)
                    if (before(GS[f], f, GS[g], g)) rank++;
                GK[g] = rank < tu[4];
            }
            barrier();
            for (uint e = t; e < E; e += WG)
                if (!GK[e / gsz]) C[e] = -1.0 / 0.0;
        }
    }
    barrier();
    uint kk = min(K, E);
    if (hash) {                      // the token's experts from the table, no ranking
        uint tok = U32(ta[4]).v[row];
        for (uint j = t; j < kk; j += WG) {
            uint e = U32(ta[3]).v[tok * tu[1] + j];
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
            R.v[tu[1] + j] = floatBitsToUint(ds ? w * uintBitsToFloat(tu[6]) : w);
        }
    }
}
