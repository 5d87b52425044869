// Q8_0: ggml block_q8_0 (ggml-common.h): { f16 d; int8 qs[32]; } = 34 bytes; w = d * qs[j].
#ifdef GGUF_BLOCKS
// The tier's kernels (common.glsl): the GGUF blocks, 2-byte aligned: ten aligned words cover one.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 34ul;
    RB32 p = RB32(b & ~3ul);
    uint s = 8u * uint(b & 3ul);
    uint a[9];   // the block's 34 bytes at a 2-byte offset s/8 in {0, 2}: nine words, none past it
    [[unroll]] for (uint k = 0u; k < 9u; k++) a[k] = p.v[k];
    float d = unpackHalf2x16(s == 0u ? a[0] & 0xffffu : a[0] >> 16).x;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        // qs bytes 4k..4k+3 are block bytes 2+4k..5+4k
        int v = int(s == 0u ? (a[k] >> 16) | (a[k + 1u] << 16) : a[k + 1u]);
        w[k] = d * vec4(bitfieldExtract(v, 0, 8), bitfieldExtract(v, 8, 8), bitfieldExtract(v, 16, 8), bitfieldExtract(v, 24, 8));
    }
}
#else
// The device layers' layout (coli/vulkan/memory.py split_q8_0): a row of nb = I / 32 blocks is its I codes, then
// its nb f16 scales (34 nb bytes, as in GGUF). The layer kernels' push word u1 is the matrix's inner size I
// (layer_common.glsl). Unit u's 32 codes are two 16-byte loads where the row is 16-byte aligned (every row when
// nb is a multiple of 8), else eight halfword pairs (a row is 2-byte aligned); its scale one halfword.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint nb = pc.u[1] / 32u;
    uint64_t c = row + uint64_t(u) * 32ul;
    float d = unpackHalf2x16(uint(RB16(row + uint64_t(nb) * 32ul + uint64_t(u) * 2ul).v[0])).x;
    uint q[8];
    if ((row & 15ul) == 0ul) {
        RB128 p = RB128(c);
        uvec4 lo = p.v[0], hi = p.v[1];
        q = uint[8](lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w);
    } else {
        RB16 p = RB16(c);
        [[unroll]] for (uint k = 0u; k < 8u; k++) q[k] = uint(p.v[2u * k]) | (uint(p.v[2u * k + 1u]) << 16);
    }
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        int v = int(q[k]);
        w[k] = d * vec4(bitfieldExtract(v, 0, 8), bitfieldExtract(v, 8, 8), bitfieldExtract(v, 16, 8), bitfieldExtract(v, 24, 8));
    }
}
#endif
