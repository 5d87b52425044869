// IQ4_NL: ggml block_iq4_nl (ggml-common.h): { f16 d; uint8 qs[16]; } = 18 bytes (2-byte aligned);
// element j < 16: d * kvalues_iq4nl[qs[j] & 15], j + 16: d * kvalues_iq4nl[qs[j] >> 4] (dequantize_row_iq4_nl).
#include "kvalues_iq4nl.glsl"
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB16 p = RB16(row + uint64_t(u) * 18ul);
    float d = unpackHalf2x16(uint(p.v[0])).x;
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint v = uint(p.v[1u + 2u * k]) | (uint(p.v[2u + 2u * k]) << 16);
        w[k] = d * kv4_lo(v);
        w[k + 4u] = d * kv4_hi(v);
    }
}
