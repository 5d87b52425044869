// NVFP4: ggml block_nvfp4 (ggml-common.h): { uint8 d[4]; uint8 qs[32]; } = 36 bytes per 64 weights (QK_NVFP4,
// sub-blocks of QK_NVFP4_SUB = 16). Sub-block s: scale ue4m3(d[s]) (ggml-impl.h ggml_ue4m3_to_fp32: unsigned,
// 4 exponent bits with bias 7, 3 mantissa bits, halved; 0x00 and 0x7F decode to 0, bit 7 is ignored); weight
// 16s + j (j < 8) is kvalues_mxfp4[qs[8s + j] & 15] * scale, weight 16s + 8 + j the high nibble's
// (dequantize_row_nvfp4). Blocks are 4-byte aligned (36 = 4 * 9, rows are whole blocks): unit u is half u & 1
// of block u >> 1, i.e. sub-blocks 2h and 2h + 1, their scales bytes 2h and 2h + 1 of word 0 and their codes
// words 1 + 4h .. 4 + 4h. Values are built from their bits (a dynamically indexed table would sit in local
// memory); every product scale * code is exact in f32.
float nvfp4_e2m1x2(uint q) {   // kvalues_mxfp4[q] (E2M1 doubled), as fmt_mxfp4.glsl's e2m1x2
    uint e = (q >> 1) & 3u, m = q & 1u;
    float v = e == 0u ? float(m) : uintBitsToFloat(((e + 127u) << 23) | (m << 22));
    return (q & 8u) != 0u ? -v : v;
}
float ue4m3_half(uint x) {     // ggml_ue4m3_to_fp32: (1 + m/8) 2^(e-7) / 2, subnormal m 2^-9 / 2
    uint e = (x >> 3) & 15u, m = x & 7u;
    float v = e == 0u ? float(m) * (1.0 / 1024.0) : uintBitsToFloat(((e + 119u) << 23) | (m << 20));
    return x == 127u ? 0.0 : v;
}
vec4 nvfp4_lo(uint v) { return vec4(nvfp4_e2m1x2(v & 15u), nvfp4_e2m1x2((v >> 8) & 15u), nvfp4_e2m1x2((v >> 16) & 15u), nvfp4_e2m1x2((v >> 24) & 15u)); }
vec4 nvfp4_hi(uint v) { return vec4(nvfp4_e2m1x2((v >> 4) & 15u), nvfp4_e2m1x2((v >> 12) & 15u), nvfp4_e2m1x2((v >> 20) & 15u), nvfp4_e2m1x2(v >> 28)); }
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    RB32 p = RB32(row + uint64_t(u >> 1) * 36ul);
    uint h = u & 1u;
    uint sc = p.v[0] >> (16u * h);
    [[unroll]] for (uint t = 0u; t < 2u; t++) {
        float d = ue4m3_half((sc >> (8u * t)) & 255u);
        uint wa = p.v[1u + 4u * h + 2u * t], wb = p.v[2u + 4u * h + 2u * t];
        w[4u * t] = d * nvfp4_lo(wa);
        w[4u * t + 1u] = d * nvfp4_lo(wb);
        w[4u * t + 2u] = d * nvfp4_hi(wa);
        w[4u * t + 3u] = d * nvfp4_hi(wb);
    }
}
