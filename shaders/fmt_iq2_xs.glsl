// IQ2_XS: ggml block_iq2_xs (ggml-common.h): { f16 d; uint16 qs[32]; uint8 scales[8]; } = 74 bytes.
// Group l of sub-block ib: v = qs[4ib + l], grid entry v & 511, signs ksigns[v >> 9]; scale nibble
// scales[ib] (low for l < 2, high for l >= 2); w = d * (0.5 + s) / 4 * grid * sign (dequantize_row_iq2_xs).
#include "iq_common.glsl"
#include "iq_grids.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint ib = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 74ul;
    RB16 p = RB16(b);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    uint sc = uint(RB8(b).v[66u + ib]);
    [[unroll]] for (uint l = 0u; l < 4u; l++) {
        uint v = uint(p.v[1u + 4u * ib + l]);
        uint gi = v & 511u;
        uint s = iq_ksigns(v >> 9);
        float db = d * (0.5 + float((sc >> (4u * (l >> 1))) & 15u)) * 0.25;
        w[2u * l] = db * iq_signed4(IQ2XS_GRID(2u * gi), s);
        w[2u * l + 1u] = db * iq_signed4(IQ2XS_GRID(2u * gi + 1u), s >> 4);
    }
}
