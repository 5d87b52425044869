// IQ1_M: ggml block_iq1_m (ggml-common.h): { uint8 qs[32]; uint8 qh[16]; uint8 scales[8]; } = 56 bytes, no
// separate d: the f16 d is the top nibbles of the four u16 scales (iq1m_scale_t). Group g (8 elements):
// nibble n = qh[g/2] >> 4(g&1), entry qs[g] | (n & 7) << 8 of iq1s_grid, delta -1/8 if n & 8 else 1/8;
// 3-bit scale k per 16 elements: (scales_u16[k/4] >> 3(k%4)) & 7; w = d * (2s + 1) * (grid + delta)
// (dequantize_row_iq1_m).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 56ul;
    RB16 p = RB16(b);
    RB8 q = RB8(b);
    uint s0 = uint(p.v[24u]), s1 = uint(p.v[25u]), s2 = uint(p.v[26u]), s3 = uint(p.v[27u]);
    float d = unpackHalf2x16((s0 >> 12) | ((s1 >> 8) & 0xf0u) | ((s2 >> 4) & 0xf00u) | (s3 & 0xf000u)).x;
    uint sw = uint(p.v[24u + (ib >> 1)]);
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint g = 4u * ib + l;
        uint n = (uint(q.v[32u + (g >> 1)]) >> (4u * (g & 1u))) & 15u;
        uint e = IQ1S_GRID(uint(q.v[g]) | ((n & 7u) << 8));
        float dl = d * float(2u * ((sw >> (6u * (ib & 1u) + 3u * (l >> 1))) & 7u) + 1u);
        float delta = (n & 8u) != 0u ? -0.125 : 0.125;
        w[2u * l] = dl * iq1_vals4(e, 0u, delta);
        w[2u * l + 1u] = dl * iq1_vals4(e, 1u, delta);
    }
}
