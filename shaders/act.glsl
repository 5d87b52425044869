// The gated FFN's activation of the whole-layer kernels (lmoe.comp, lmm.comp), act numbered as
// cpu_kernels/experts.py's ACT_*: 0 SiLU (SwiGLU: g / (1 + exp(-g)) u), 1 the tanh GELU (Gemma's GeGLU, HF
// gelu_pytorch_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) u), 2 gpt-oss's clamped SwiGLU
// (g sigmoid(1.702 g) (u + 1)). With limit > 0 (SiLU and gpt-oss's): g = min(g, limit), u clamped to +-limit
// first. The tanh's argument is clamped to +-10 (tanh is 1 - 4e-9 there, 1.0 in f32), so no implementation's
// exp-based tanh overflows to inf / inf.
float glu(float g, float u, uint act, float limit) {
    if (act != 1u && limit > 0.0) {
        g = min(g, limit);
        u = clamp(u, -limit, limit);
    }
    if (act == 2u) {
        float z = 1.702 * g;
        if (z < -80.0) return 0.0 * u;   // exp(-z) would overflow: the gate is ~0 (the CPU's rule)
        return g / (1.0 + exp(-z)) * (u + 1.0);
    }
    if (act == 1u) {
        float y = 0.7978845608028654 * (g + 0.044715 * g * g * g);
        return 0.5 * g * (1.0 + tanh(clamp(y, -10.0, 10.0))) * u;
    }
    return g / (1.0 + exp(-g)) * u;
}
