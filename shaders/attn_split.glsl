// The prompt attention's keys split over workgroups (attn_pre.comp, attn_pre_cm.comp; coli/vulkan/layers.py
// Kernels.attn_split): parts of CHK keys (part s: keys s CHK .. s CHK + CHK - 1, CHK a multiple of both kernels' key
// tiles), workgroup z of NS (grid z) taking parts z, z + NS, z + 2 NS, .. in one online softmax. A row whose keys lie
// in one part is written whole by the workgroup holding that part; a row whose keys span parts has each workgroup
// write its (max m, sum l, weighted V sum o) to a6 parts f32 [NS, R, nq, hdv + 2] and attn_pre.comp's join pass
// (u11 = 1) combines them (flash-decoding). The parts are fixed multiples of CHK, so a row's result depends on
// its position, NS and CHK only, not on its block or chunk. u9 NS (0 or 1: no split), u10 CHK.

// the first key row p sees (window W: p - W + 1 on) and the keys it sees (n: 0 .. n - 1)
uint row_first_key(uint p, uint W) { return (W > 0u && p + 1u > W) ? p + 1u - W : 0u; }

// row p's keys span more than one part (it goes through the parts and the join)
bool row_split(uint p, uint ctx, uint W, uint NS, uint CHK) {
    return NS > 1u && row_first_key(p, W) / CHK != (min(p + 1u, ctx) - 1u) / CHK;
}

// workgroup z writes row p whole: no split, or the row's one part is z's
bool row_whole_here(uint p, uint ctx, uint W, uint NS, uint CHK, uint z) {
    return NS <= 1u || (!row_split(p, ctx, W, NS, CHK) && (row_first_key(p, W) / CHK) % NS == z);
}

// keys a .. b - 1 of workgroup z's i-th part (a >= b: none left; no split: every key 0 .. n - 1 as one part)
uvec2 part_keys(uint i, uint z, uint n, uint NS, uint CHK) {
    if (NS <= 1u) return i == 0u ? uvec2(0u, n) : uvec2(n, n);
    uint a = (z + i * NS) * CHK;
    return a >= n ? uvec2(n, n) : uvec2(a, min(a + CHK, n));
}
