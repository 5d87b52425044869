// The K/V cache's storage types on the device (the CPU's cpu_kernels/kvcache.py, llama.cpp's --cache-type-k/-v):
// specialization constant 6 KT (K's), 7 VT (V's): 0 f32 (4 bytes a value), 1 f16 (IEEE half bits), 2 bf16 (the
// top half of the f32 bits), 3 q8_0; a 16-bit side packs values 2i and 2i + 1 into word i (2i in the low half, NumPy's
// little-endian uint16 [n, ctx, w] as the CPU keeps it, so rows travel as bytes both ways). A q8_0 side is GGUF's
// block_q8_0 (an f16 scale d, then 32 int8 codes; 34 bytes, so a block starts 2-byte aligned) for every 32 values
// of [n, ctx, w] in order: value i is block i / 32's code i % 32 times its d (the CPU keeps codes and scales apart:
// rows move as these blocks, layer_kv.py); written by kv_store_q8 (one block an invocation). Writes round to
// nearest even as the CPU's f2h / f2b do (so a row converted here has the bits the CPU's conversion gives); reads
// are exact (f16 subnormals as the device's unpackHalf2x16 gives them). Needs layer_common.glsl first.
layout(constant_id = 6) const uint KT = 0u;
layout(constant_id = 7) const uint VT = 0u;

layout(buffer_reference, std430, buffer_reference_align = 8) buffer U32x2 { uvec2 v[]; };

// the two values of a 16-bit side's word w (type t: 1 f16, 2 bf16)
vec2 kv_unpack2(uint w, uint t) {
    return t == 1u ? unpackHalf2x16(w) : vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u));
}

// the 16 bits at byte offset o (even) of the buffer at a
uint kv_u16(uint64_t a, uint o) {
    uint w = U32(a).v[o >> 2];
    return (o & 2u) != 0u ? w >> 16 : w & 0xFFFFu;
}

// the 4 bytes at byte offset o (even) of the buffer at a, as a little-endian word
uint kv_u32at(uint64_t a, uint o) {
    U32 W = U32(a);
    uint w = W.v[o >> 2];
    return (o & 2u) != 0u ? (w >> 16) | (W.v[(o >> 2) + 1u] << 16) : w;
}

// value i of a q8_0 side at a: code * d (ggml's dequantize_row_q8_0)
float kv_q8(uint64_t a, uint i) {
    uint o = (i >> 5) * 34u;
    uint w = U32(a).v[(o + 2u + (i & 31u)) >> 2];
    float d = unpackHalf2x16(kv_u16(a, o)).x;
    return float(bitfieldExtract(int(w), int(((o + 2u + (i & 31u)) & 3u) * 8u), 8)) * d;
}

// values 4i .. 4i + 3 of a q8_0 side at a (one block's)
vec4 kv_q8x4(uint64_t a, uint i) {
    uint o = (i >> 3) * 34u;
    int c = int(kv_u32at(a, o + 2u + 4u * (i & 7u)));
    float d = unpackHalf2x16(kv_u16(a, o)).x;
    return vec4(float(bitfieldExtract(c, 0, 8)) * d, float(bitfieldExtract(c, 8, 8)) * d,
                float(bitfieldExtract(c, 16, 8)) * d, float(bitfieldExtract(c, 24, 8)) * d);
}

// value i of the side at address a of type t
float kv_load(uint64_t a, uint i, uint t) {
    if (t == 0u) return F32(a).v[i];
    if (t == 3u) return kv_q8(a, i);
    return kv_unpack2(U32(a).v[i >> 1], t)[i & 1u];
}

// values 4i .. 4i + 3 of the side at address a of type t (a 16-byte aligned row for f32, 8-byte for 16-bit)
vec4 kv_load4(uint64_t a, uint i, uint t) {
    if (t == 0u) return F32x4(a).v[i];
    if (t == 3u) return kv_q8x4(a, i);
    uvec2 w = U32x2(a).v[i];
    return vec4(kv_unpack2(w.x, t), kv_unpack2(w.y, t));
}

// f32 -> f16 bits, rounded to nearest even (overflow to inf, subnormals rounded, NaN quiet): LLVM's fptrunc
uint kv_f2h(float x) {
    uint u = floatBitsToUint(x);
    uint s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return s | 0x7E00u | ((a >> 13) & 0x3FFu);
    if (a >= 0x477FF000u) return s | 0x7C00u;            // 65520 and up round to inf
    if (a < 0x38800000u) {                               // below 2^-14: a subnormal half (units of 2^-24) or 0
        uint e = a >> 23, sh = 126u - e;
        if (e == 0u || sh > 24u) return s;
        uint m = (a & 0x7FFFFFu) | 0x800000u;
        uint r = m >> sh, rem = m & ((1u << sh) - 1u), half_ = 1u << (sh - 1u);
        if (rem > half_ || (rem == half_ && (r & 1u) != 0u)) r++;
        return s | r;
    }
    uint h = (a - 0x38000000u) >> 13, rem = a & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0u)) h++;
    return s | h;
}

// f32 -> bf16 bits, rounded to nearest even (a NaN stays a quiet NaN): ggml's GGML_FP32_TO_BF16
uint kv_f2b(float x) {
    uint u = floatBitsToUint(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 64u;
    return (u + (0x7FFFu + ((u >> 16) & 1u))) >> 16;
}

// values 2i, 2i + 1 (x0, x1) into the 16-bit side at address a of type t (1 f16, 2 bf16)
void kv_store2(uint64_t a, uint i, float x0, float x1, uint t) {
    U32 W = U32(a);
    W.v[i] = t == 1u ? kv_f2h(x0) | (kv_f2h(x1) << 16) : kv_f2b(x0) | (kv_f2b(x1) << 16);
}

// a / b (a, b > 0) rounded to nearest even, as the CPU's f32 division (a Vulkan OpFDiv may be ulps off): the
// mantissas' quotient in 64-bit integers, rounded by its remainder; a quotient outside the normal range (never for
// a q8_0 scale of values above 2^-119) takes the device's division
float kv_div(float a, float b) {
    uint ua = floatBitsToUint(a), ub = floatBitsToUint(b);
    int ea = int(ua >> 23), eb = int(ub >> 23);
    if (ea == 0 || eb == 0 || ea == 255 || eb == 255) return a / b;
    uint64_t ma = uint64_t((ua & 0x7FFFFFu) | 0x800000u), mb = uint64_t((ub & 0x7FFFFFu) | 0x800000u);
    uint64_t N = ma << 40, Q = N / mb;
    bool exact = N - Q * mb == 0ul;
    int sh = findMSB(uint(Q >> 32)) + 32 - 23;          // Q in (2^39, 2^41): 24 bits kept
    uint64_t m = Q >> sh, rb = Q & ((uint64_t(1) << sh) - 1ul), hf = uint64_t(1) << (sh - 1);
    if (rb > hf || (rb == hf && (!exact || (m & 1ul) != 0ul))) m++;
    int e = sh - 40 + ea - eb + 150;      // m 2^(e - 150) is a / b
    if (m == (uint64_t(1) << 24)) { m >>= 1; e++; }
    if (e < 1 || e > 254) return a / b;
    return uintBitsToFloat((uint(e) << 23) | (uint(m) & 0x7FFFFFu));
}

// x rounded half away from zero (C's roundf: the CPU's codes), exact for every f32
float kv_roundf(float x) {
    float a = abs(x), t = trunc(a);
    precise float f = a - t;
    return sign(x) * (f >= 0.5 ? t + 1.0 : t);
}

// the q8_0 block b (values 32b .. 32b + 31, x) of the side at a, as the CPU's quantize_row_q8_0_ref: d = amax / 127,
// codes roundf(x / d... times 1 / d) (0 where d is 0), d stored as f16; one invocation a block (the halves of a
// word a neighbouring block shares are written with atomics, the rest as whole words)
void kv_store_q8(uint64_t a, uint b, float x[32]) {
    float amax = 0.0;
    for (uint j = 0u; j < 32u; j++) amax = max(amax, abs(x[j]));
    float d = kv_div(amax, 127.0);
    float id = d != 0.0 ? kv_div(1.0, d) : 0.0;
    uint h[17];
    h[0] = kv_f2h(d);
    for (uint j = 0u; j < 16u; j++) {
        precise float v0 = x[2u * j] * id;
        precise float v1 = x[2u * j + 1u] * id;
        h[j + 1u] = (uint(int(kv_roundf(v0))) & 0xFFu) | ((uint(int(kv_roundf(v1))) & 0xFFu) << 8);
    }
    U32 W = U32(a);
    uint w0 = (b * 34u) >> 2;
    if ((b & 1u) == 0u) {      // starts word-aligned: 8 whole words, then the low half of a shared word
        for (uint k = 0u; k < 8u; k++) W.v[w0 + k] = h[2u * k] | (h[2u * k + 1u] << 16);
        atomicAnd(W.v[w0 + 8u], 0xFFFF0000u);
        atomicOr(W.v[w0 + 8u], h[16]);
    } else {                   // the high half of a shared word, then 8 whole words
        atomicAnd(W.v[w0], 0xFFFFu);
        atomicOr(W.v[w0], h[0] << 16);
        for (uint k = 0u; k < 8u; k++) W.v[w0 + 1u + k] = h[2u * k + 1u] | (h[2u * k + 2u] << 16);
    }
}
