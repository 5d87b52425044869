// TQ1_0: ggml block_tq1_0 (ggml-common.h): { uint8 qs[48]; uint8 qh[4]; f16 d; } = 54 bytes for 256
// elements (2-byte aligned). Base-3 digits, digit k of a byte = ((byte * 3^k) mod 256 * 3) >> 8: elements
// 0-159 from qs[0..31] (digit k: elements 32k..32k+31), 160-239 from qs[32..47] (16 per digit), 240-255
// from qh (4 per digit); w = d * (digit - 1) (dequantize_row_tq1_0).
float tq1_digit(RB8 p, uint e) {
    uint byte_i, k;
    if (e < 160u) { byte_i = e & 31u; k = e >> 5; }
    else if (e < 240u) { byte_i = 32u + ((e - 160u) & 15u); k = (e - 160u) >> 4; }
    else { byte_i = 48u + ((e - 240u) & 3u); k = (e - 240u) >> 2; }
    uint pw = k == 0u ? 1u : (k == 1u ? 3u : (k == 2u ? 9u : (k == 3u ? 27u : 81u)));
    return float((((uint(p.v[byte_i]) * pw) & 255u) * 3u) >> 8) - 1.0;
}
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u >> 3) * 54ul;
    RB8 p = RB8(b);
    float d = unpackHalf2x16(uint(RB16(b + 52ul).v[0])).x;
    uint e0 = 32u * (u & 7u);
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint e = e0 + 4u * k;
        w[k] = d * vec4(tq1_digit(p, e), tq1_digit(p, e + 1u), tq1_digit(p, e + 2u), tq1_digit(p, e + 3u));
    }
}
