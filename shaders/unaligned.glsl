// Reading a block that starts at any byte address with aligned 32-bit loads: word i of the bytes at b
// is funnel-shifted out of the aligned words at (b & ~3). The shift is dynamic, the word index static.
uint uw_shift(uint64_t b) { return 8u * uint(b & 3ul); }
uint uw_get(uint lo, uint hi, uint s) { return s == 0u ? lo : (lo >> s) | (hi << (32u - s)); }
