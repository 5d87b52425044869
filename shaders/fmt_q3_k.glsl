// Q3_K: ggml block_q3_K (ggml-common.h): { uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; f16 d; } = 110
// bytes for 256 elements (2-byte aligned only: read as 16-bit words). Element e = 128n + 32j + l:
// q = ((qs[32n + l] >> 2j) & 3) | (bit 4n+j of hmask[l]) << 2, minus 4; sub-block s = e / 16 has the 6-bit
// scale (s < 8 ? scales[s] & 15 : scales[s-8] >> 4) | ((scales[8 + s%4] >> 2(s/4)) & 3) << 4, minus 32;
// w = d * sc * q (dequantize_row_q3_K).
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint uu = u & 7u, n = uu >> 2, j = uu & 3u;
    uint64_t b = row + uint64_t(u >> 3) * 110ul;
    RB8 s = RB8(b + 96ul);
    float d = unpackHalf2x16(uint(RB16(b + 108ul).v[0])).x;
    uint k0 = 8u * n + 2u * j, k1 = k0 + 1u;
    uint lo0 = (uint(s.v[k0 & 7u]) >> (4u * (k0 >> 3))) & 15u, lo1 = (uint(s.v[k1 & 7u]) >> (4u * (k1 >> 3))) & 15u;
    uint hi0 = (uint(s.v[8u + (k0 & 3u)]) >> (2u * (k0 >> 2))) & 3u, hi1 = (uint(s.v[8u + (k1 & 3u)]) >> (2u * (k1 >> 2))) & 3u;
    float s0 = d * float(int(lo0 | (hi0 << 4)) - 32), s1 = d * float(int(lo1 | (hi1 << 4)) - 32);
    RB16 hm = RB16(b);
    RB16 ql = RB16(b + 32ul + uint64_t(n) * 32ul);
    uint sh = 2u * j, hb = 4u * n + j;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint lv = (uint(ql.v[2u * k]) | (uint(ql.v[2u * k + 1u]) << 16)) >> sh;
        uint hv = (uint(hm.v[2u * k]) | (uint(hm.v[2u * k + 1u]) << 16)) >> hb;
        vec4 q = vec4((lv & 3u) | ((hv & 1u) << 2), ((lv >> 8) & 3u) | (((hv >> 8) & 1u) << 2),
                      ((lv >> 16) & 3u) | (((hv >> 16) & 1u) << 2), ((lv >> 24) & 3u) | (((hv >> 24) & 1u) << 2)) - 4.0;
        w[k] = (k < 4u ? s0 : s1) * q;
    }
}
