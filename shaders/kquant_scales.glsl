// The 6-bit scales and mins of Q4_K and Q5_K (ggml-quants.c get_scale_min_k4): 12 bytes s[0..11],
// sub-block j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
// m = (s[j+4] >> 4) | (s[j] >> 6) << 4. `sw` holds s as three little-endian words.
uint kq_byte(uvec3 sw, uint i) { return (sw[i >> 2] >> (8u * (i & 3u))) & 255u; }
vec2 kq_scale_min(uvec3 sw, uint j) {
    if (j < 4u) return vec2(kq_byte(sw, j) & 63u, kq_byte(sw, j + 4u) & 63u);
    return vec2((kq_byte(sw, j + 4u) & 15u) | ((kq_byte(sw, j - 4u) >> 6) << 4),
                (kq_byte(sw, j + 4u) >> 4) | ((kq_byte(sw, j) >> 6) << 4));
}
