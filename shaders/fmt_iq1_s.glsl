// IQ1_S: ggml block_iq1_s (ggml-common.h): { f16 d; uint8 qs[32]; uint16 qh[8]; } = 50 bytes. Sub-block
// ib: h = qh[ib]; group l: entry qs[4ib + l] | ((h >> 3l) & 7) << 8 of iq1s_grid (values -1, 0, 1);
// w = d * (2 * ((h >> 12) & 7) + 1) * (grid + delta), delta = -1/8 if h & 0x8000 else 1/8
// (dequantize_row_iq1_s).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    RB16 p = RB16(row + uint64_t(u >> 3) * 50ul);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    uint h = uint(p.v[17u + ib]);
    float dl = d * float(2u * ((h >> 12) & 7u) + 1u);
    float delta = (h & 0x8000u) != 0u ? -0.125 : 0.125;
    uint qs = uint(p.v[1u + 2u * ib]) | (uint(p.v[2u + 2u * ib]) << 16);
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint e = IQ1S_GRID(((qs >> (8u * l)) & 255u) | (((h >> (3u * l)) & 7u) << 8));
        w[2u * l] = dl * iq1_vals4(e, 0u, delta);
        w[2u * l + 1u] = dl * iq1_vals4(e, 1u, delta);
    }
}
