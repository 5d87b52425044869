// Q4_K: ggml block_q4_K (ggml-common.h): { f16 d; f16 dmin; uint8 scales[12]; uint8 qs[128]; } = 144
// bytes for 256 elements; sub-block j (32 elements) reads qs[(j/2)*32 + l], low nibble for even j,
// high for odd; w = d * sc[j] * q - dmin * m[j].
#include "kquant_scales.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint j = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 144ul;
    RB32 p = RB32(b);
    vec2 dd = unpackHalf2x16(p.v[0]);
    vec2 sm = kq_scale_min(p.v[1], p.v[2], p.v[3], j);
    float dl = dd.x * sm.x, ml = dd.y * sm.y;
    uint sh = 4u * (j & 1u);
    RB32 q = RB32(b + 16ul + uint64_t(j >> 1) * 32ul);
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint v = q.v[k] >> sh;
        w[k] = dl * vec4(v & 15u, (v >> 8) & 15u, (v >> 16) & 15u, (v >> 24) & 15u) - ml;
    }
}
