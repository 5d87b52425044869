// Q8_0: ggml block_q8_0 (ggml-common.h): { f16 d; int8 qs[32]; } = 34 bytes; w = d * qs[j].
#define ROW_BYTES(I) (((I) / 32u) * 34u)
void dec_unit(uint64_t row, uint u, out vec4 w[8]) {
    uint64_t b = row + uint64_t(u) * 34ul;
    float d = unpackHalf2x16(uint(RB16(b).v[0])).x;
    RB16 q = RB16(b + 2ul);
    [[unroll]] for (uint k = 0u; k < 8u; k++) {
        int v0 = int(uint(q.v[2u * k])), v1 = int(uint(q.v[2u * k + 1u]));
        w[k] = d * vec4(bitfieldExtract(v0, 0, 8), bitfieldExtract(v0, 8, 8),
                        bitfieldExtract(v1, 0, 8), bitfieldExtract(v1, 8, 8));
    }
}
