// Picks the block decoder of one GGUF format; scripts/build_shaders compiles each kernel once per format
// with -DFMT_<NAME>. Every decoder gives `void dec_unit(uint64_t row, uint u, out vec4 w[8])`: the
// u-th 32-element unit of the weight row at device address `row`, and ROW_BYTES(I).
#if defined(FMT_F32)
#include "fmt_f32.glsl"
#elif defined(FMT_F16)
#include "fmt_f16.glsl"
#elif defined(FMT_BF16)
#include "fmt_bf16.glsl"
#elif defined(FMT_Q8_0)
#include "fmt_q8_0.glsl"
#elif defined(FMT_Q4_0)
#include "fmt_q4_0.glsl"
#elif defined(FMT_Q4_1)
#include "fmt_q4_1.glsl"
#elif defined(FMT_Q5_0)
#include "fmt_q5_0.glsl"
#elif defined(FMT_Q4_K)
#include "fmt_q4_k.glsl"
#elif defined(FMT_Q5_K)
#include "fmt_q5_k.glsl"
#elif defined(FMT_Q6_K)
#include "fmt_q6_k.glsl"
#elif defined(FMT_MXFP4)
#include "fmt_mxfp4.glsl"
#elif defined(FMT_IQ2_XXS)
#include "fmt_iq2_xxs.glsl"
#elif defined(FMT_IQ2_XS)
#include "fmt_iq2_xs.glsl"
#elif defined(FMT_IQ2_S)
#include "fmt_iq2_s.glsl"
#elif defined(FMT_IQ3_XXS)
#include "fmt_iq3_xxs.glsl"
#elif defined(FMT_IQ3_S)
#include "fmt_iq3_s.glsl"
#elif defined(FMT_IQ1_S)
#include "fmt_iq1_s.glsl"
#elif defined(FMT_IQ1_M)
#include "fmt_iq1_m.glsl"
#else
#error "no FMT_ defined"
#endif
