// Q8_0: ggml block_q8_0 (ggml-common.h): { f16 d; int8 qs[32]; } = 34 bytes; w = d * qs[j].
// The block is 2-byte aligned: ten aligned words cover it.
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
