// A row of any width (lmv.comp, lmm.comp, lmoe.comp): an F32/F16/BF16 matrix of I inputs, I not a multiple of 32, is
// placed with its rows zero-padded to ceil(I / 32) units (Device._place); the last unit's inputs past I read as 0
// (a finite 0 times the zero weights: the next row's values or unwritten memory might be NaN).
// x_units(I): the 32-input units a row takes; x_row_bytes: a weight row's bytes at that padded length.
#define x_units(I) (((I) + 31u) / 32u)
#define x_row_bytes(I) ROW_BYTES(x_units(I) * 32u)

// Unit u of the activation row that starts at float xoff of xa, one float at a time (no vec4 alignment: a row of I
// floats starts at a multiple of 4 only when I is), inputs from I on 0.
void x_unit_any(uint64_t xa, uint xoff, uint I, uint u, out vec4 xv[8]) {
    F32 X = F32(xa);
    [[unroll]] for (uint q = 0u; q < 8u; q++) [[unroll]] for (uint c = 0u; c < 4u; c++) {
        uint i = u * 32u + q * 4u + c;
        xv[q][c] = i < I ? X.v[xoff + i] : 0.0;
    }
}
