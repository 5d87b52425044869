// The gated FFN's activation of the whole-layer kernels (lmoe.comp, lmm.comp): act(g) * u with act 0 SiLU
// (SwiGLU: g / (1 + exp(-g))), 1 the tanh GELU (Gemma's GeGLU, HF gelu_pytorch_tanh; CPU cpu_kernels/norms.py
// geglu_tanh: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))). The tanh's argument is clamped to +-10 (tanh is
// 1 - 4e-9 there, 1.0 in f32), so no implementation's exp-based tanh overflows to inf / inf.
float glu(float g, float u, uint act) {
    if (act == 1u) {
        float y = 0.7978845608028654 * (g + 0.044715 * g * g * g);
        return 0.5 * g * (1.0 + tanh(clamp(y, -10.0, 10.0))) * u;
    }
    return g / (1.0 + exp(-g)) * u;
}
