// Q5_K: ggml block_q5_K (ggml-common.h): { f16 d; f16 dmin; uint8 scales[12]; uint8 qh[32];
// uint8 qs[128]; } = 176 bytes for 256 elements; sub-block j, element l: low 4 bits as Q4_K,
// fifth bit = bit j of qh[l]; w = d * sc[j] * q - dmin * m[j].
#include "kquant_scales.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint j = u & 7u;
    uint64_t b = row + uint64_t(u >> 3) * 176ul;
    RB32 p = RB32(b);
    vec2 dd = unpackHalf2x16(p.v[0]);
    vec2 sm = kq_scale_min(p.v[1], p.v[2], p.v[3], j);
    float dl = dd.x * sm.x, ml = dd.y * sm.y;
    uint sh = 4u * (j & 1u);
    RB32 h = RB32(b + 16ul);
    RB32 q = RB32(b + 48ul + uint64_t(j >> 1) * 32ul);
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint v = q.v[k] >> sh;
        uint hv = h.v[k] >> j;
        w[k] = dl * vec4((v & 15u) | ((hv & 1u) << 4), ((v >> 8) & 15u) | (((hv >> 8) & 1u) << 4),
                         ((v >> 16) & 15u) | (((hv >> 16) & 1u) << 4), ((v >> 24) & 15u) | (((hv >> 24) & 1u) << 4)) - ml;
    }
}
