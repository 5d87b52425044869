// MXFP4: ggml block_mxfp4 (ggml-common.h): { uint8 e; uint8 qs[16]; } = 17 bytes; e2m1 codes
// (kvalues_mxfp4, doubled: 0 1 2 3 4 6 8 12 and their negatives) times the e8m0 scale halved
// (ggml-impl.h ggml_e8m0_to_fp32_half); element j < 16 from qs[j] & 15, element j + 16 from qs[j] >> 4.
// The e2m1 value is built from its bits (a dynamically indexed table would sit in local memory).
#include "unaligned.glsl"
float e2m1x2(uint q) {
    uint e = (q >> 1) & 3u, m = q & 1u;
    float v = e == 0u ? float(m) : uintBitsToFloat(((e + 127u) << 23) | (m << 22));
    return (q & 8u) != 0u ? -v : v;
}
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 17ul;
    RB32 p = RB32(b & ~3ul);
    uint s = uw_shift(b);
    uint a[5];   // 17 bytes at any byte offset: five aligned words, none past the block
    [[unroll]] for (uint k = 0u; k < 5u; k++) a[k] = p.v[k];
    uint e = uw_get(a[0], a[1], s) & 255u;
    float d = e < 2u ? uintBitsToFloat(0x00200000u << e) : uintBitsToFloat((e - 1u) << 23);
    // qs bytes 4k..4k+3 are block bytes 1+4k..4+4k: the word at byte offset 1 + 4k
    uint s1 = s + 8u;
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = s1 < 32u ? uw_get(a[k], a[k + 1u], s1) : a[k + 1u];
        w[k] = d * vec4(e2m1x2(v & 15u), e2m1x2((v >> 8) & 15u), e2m1x2((v >> 16) & 15u), e2m1x2((v >> 24) & 15u));
        w[k + 4u] = d * vec4(e2m1x2((v >> 4) & 15u), e2m1x2((v >> 12) & 15u), e2m1x2((v >> 20) & 15u), e2m1x2(v >> 28));
    }
}
