// Q6_K: ggml block_q6_K (ggml-common.h): { uint8 ql[128]; uint8 qh[64]; int8 scales[16]; f16 d; }
// = 210 bytes for 256 elements. Element e: half h = e/128, c = (e%128)/32, l = e%32:
// q = ((ql[h*64 + (c&1)*32 + l] >> 4*(c>>1)) & 15) | ((qh[h*32 + l] >> 2c) & 3) << 4, minus 32;
// w = d * scales[e/16] * q.
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint uu = u & 7u, h = uu >> 2, c = uu & 3u;
    uint64_t b = row + uint64_t(u >> 3) * 210ul;
    RB16 ql = RB16(b + uint64_t(h * 64u + (c & 1u) * 32u));
    RB16 qh = RB16(b + 128ul + uint64_t(h * 32u));
    RB8 sc = RB8(b + 192ul);
    float d = unpackHalf2x16(uint(RB16(b + 208ul).v[0])).x;
    float s0 = d * float(bitfieldExtract(int(uint(sc.v[2u * uu])), 0, 8));
    float s1 = d * float(bitfieldExtract(int(uint(sc.v[2u * uu + 1u])), 0, 8));
    uint shl = 4u * (c >> 1), shh = 2u * c;
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint lv = (uint(ql.v[2u * k]) | (uint(ql.v[2u * k + 1u]) << 16)) >> shl;
        uint hv = (uint(qh.v[2u * k]) | (uint(qh.v[2u * k + 1u]) << 16)) >> shh;
        vec4 q = vec4((lv & 15u) | ((hv & 3u) << 4), ((lv >> 8) & 15u) | (((hv >> 8) & 3u) << 4),
                      ((lv >> 16) & 15u) | (((hv >> 16) & 3u) << 4), ((lv >> 24) & 15u) | (((hv >> 24) & 3u) << 4)) - 32.0;
        w[k] = (k < 4u ? s0 : s1) * q;
    }
}
