// The K/V cache's storage types on the device (the CPU's cpu_kernels/kvcache.py, llama.cpp's --cache-type-k/-v):
// specialization constant 6 KT (K's), 7 VT (V's): 0 f32 (4 bytes a value), 1 f16 (IEEE half bits), 2 bf16 (the
// top half of the f32 bits); a 16-bit side packs values 2i and 2i + 1 into word i (2i in the low half, NumPy's
// little-endian uint16 [n, ctx, w] as the CPU keeps it, so rows travel as bytes both ways). Writes round to
// nearest even as the CPU's f2h / f2b do (so a row converted here has the bits the CPU's conversion gives); reads
// are exact (f16 subnormals as the device's unpackHalf2x16 gives them). Needs layer_common.glsl first.
layout(constant_id = 6) const uint KT = 0u;
layout(constant_id = 7) const uint VT = 0u;

layout(buffer_reference, std430, buffer_reference_align = 8) buffer U32x2 { uvec2 v[]; };

// the two values of a 16-bit side's word w (type t: 1 f16, 2 bf16)
vec2 kv_unpack2(uint w, uint t) {
    return t == 1u ? unpackHalf2x16(w) : vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xFFFF0000u));
}

// value i of the side at address a of type t
float kv_load(uint64_t a, uint i, uint t) {
    if (t == 0u) return F32(a).v[i];
    return kv_unpack2(U32(a).v[i >> 1], t)[i & 1u];
}

// values 4i .. 4i + 3 of the side at address a of type t (a 16-byte aligned row for f32, 8-byte for 16-bit)
vec4 kv_load4(uint64_t a, uint i, uint t) {
    if (t == 0u) return F32x4(a).v[i];
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
