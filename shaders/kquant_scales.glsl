// The 6-bit scales and mins of Q4_K and Q5_K (ggml-quants.c get_scale_min_k4): 12 bytes s[0..11],
// sub-block j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
// m = (s[j+4] >> 4) | (s[j] >> 6) << 4. s0, s1, s2 are s as three little-endian words (no dynamic
// indexing: a dynamically indexed vector can land in local memory).
vec2 kq_scale_min(uint s0, uint s1, uint s2, uint j) {
    uint sh = 8u * (j & 3u);
    uint a = s0 >> sh, b = s1 >> sh, c = s2 >> sh;
    if (j < 4u) return vec2(a & 63u, b & 63u);
    return vec2((c & 15u) | (((a >> 6) & 3u) << 4), ((c >> 4) & 15u) | (((b >> 6) & 3u) << 4));
}
