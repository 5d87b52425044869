// IQ4_XS: ggml block_iq4_xs (ggml-common.h): { f16 d; uint16 scales_h; uint8 scales_l[4]; uint8 qs[128]; }
// = 136 bytes for 256 elements. Sub-block ib (32 elements): ls = ((scales_l[ib/2] >> 4(ib%2)) & 15) |
// ((scales_h >> 2ib) & 3) << 4; element j < 16: d * (ls - 32) * kvalues_iq4nl[qs[16ib + j] & 15], j + 16:
// the high nibble (dequantize_row_iq4_xs).
#include "kvalues_iq4nl.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 136ul;
    RB32 p = RB32(b);
    uint w0 = p.v[0];
    uint ls = ((p.v[1] >> (4u * ib)) & 15u) | (((w0 >> (16u + 2u * ib)) & 3u) << 4);
    float dl = unpackHalf2x16(w0).x * float(int(ls) - 32);
    RB32 q = RB32(b + 8ul + uint64_t(ib) * 16ul);
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = q.v[k];
        w[k] = dl * kv4_lo(v);
        w[k + 4u] = dl * kv4_hi(v);
    }
}
