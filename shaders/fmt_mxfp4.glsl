// MXFP4: ggml block_mxfp4 (ggml-common.h): { uint8 e; uint8 qs[16]; } = 17 bytes; e2m1 codes
// (kvalues_mxfp4, doubled) times the e8m0 scale halved (ggml-impl.h ggml_e8m0_to_fp32_half);
// element j < 16 from qs[j] & 15, element j + 16 from qs[j] >> 4.
#define ROW_BYTES(I) (((I) / 32u) * 17u)
const float KV_MXFP4[16] = float[16](0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.);
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 17ul;
    RB8 p = RB8(b);
    uint e = uint(p.v[0]);
    float d = e < 2u ? uintBitsToFloat(0x00200000u << e) : uintBitsToFloat((e - 1u) << 23);
    [[unroll]] for (uint k = 0u; k < 4u; k++) {
        uint b0 = uint(p.v[1u + 4u * k]), b1 = uint(p.v[2u + 4u * k]);
        uint b2 = uint(p.v[3u + 4u * k]), b3 = uint(p.v[4u + 4u * k]);
        w[k] = d * vec4(KV_MXFP4[b0 & 15u], KV_MXFP4[b1 & 15u], KV_MXFP4[b2 & 15u], KV_MXFP4[b3 & 15u]);
        w[k + 4u] = d * vec4(KV_MXFP4[b0 >> 4], KV_MXFP4[b1 >> 4], KV_MXFP4[b2 >> 4], KV_MXFP4[b3 >> 4]);
    }
}
