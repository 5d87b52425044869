// Q2_K: ggml block_q2_K (ggml-common.h): { uint8 scales[16]; uint8 qs[64]; f16 d; f16 dmin; } = 84 bytes
// for 256 elements. Element e = 128n + 32j + l: q = (qs[32n + l] >> 2j) & 3, sub-block s = e / 16
// (scales[s] & 15: scale, >> 4: min); w = d * sc * q - dmin * mn (dequantize_row_q2_K).
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint uu = u & 7u, n = uu >> 2, j = uu & 3u;
    uint64_t b = row + uint64_t(u >> 3) * 84ul;
    RB32 p = RB32(b);
    vec2 dd = unpackHalf2x16(p.v[20]);
    uint si = 8u * n + 2u * j;                      // even: both scale bytes in one word
    uint sw = p.v[si >> 2] >> (8u * (si & 3u));
    float d0 = dd.x * float(sw & 15u), m0 = dd.y * float((sw >> 4) & 15u);
    float d1 = dd.x * float((sw >> 8) & 15u), m1 = dd.y * float((sw >> 12) & 15u);
    RB32 q = RB32(b + 16ul + uint64_t(n) * 32ul);
    uint sh = 2u * j;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint v = q.v[k] >> sh;
        vec4 c = vec4(v & 3u, (v >> 8) & 3u, (v >> 16) & 3u, (v >> 24) & 3u);
        w[k] = k < 4u ? d0 * c - m0 : d1 * c - m1;
    }
}
