// FP8_E4M3_B128: coli's own type (coli/fp8_blocks.py; docs/formats.md): blocks of 128 weights along a row,
// { f32 scale; uint8 e4m3[128]; } = 132 bytes, w = e4m3(code) * scale; the scale is the checkpoint's
// weight_scale_inv of the 128x128 block. E4M3 "fn" (OCP FP8; torch.float8_e4m3fn): sign, 4 exponent bits
// (bias 7), 3 mantissa bits; exponent 0 is subnormal m/8 * 2^-6. The value is built from its bits (shifting
// the 7 magnitude bits under an f32 exponent of 120 re-biases 7 -> 127); the NaN codes 0x7F/0xFF, which no
// checkpoint holds, decode as 480 here (the NumPy reference gives NaN). Blocks are 4-byte aligned (132 = 4 * 33
// and row bytes are whole blocks): unit u is block u / 4, codes 32 * (u % 4) .. +31, eight aligned words.
float e4m3(uint c) {
    uint a = c & 0x7fu;
    float v = a < 8u ? float(a) * (1.0 / 512.0) : uintBitsToFloat((a << 20) + (120u << 23));
    return (c & 0x80u) != 0u ? -v : v;
}
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u >> 2) * 132ul;
    RB32 p = RB32(b);
    float d = uintBitsToFloat(p.v[0]);
    uint o = 1u + 8u * (u & 3u);   // word index of the unit's first code
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        uint v = p.v[o + k];
        w[k] = d * vec4(e4m3(v & 255u), e4m3((v >> 8) & 255u), e4m3((v >> 16) & 255u), e4m3(v >> 24));
    }
}
