// The RMSNorm of the vector a dispatch just wrote, taken by its last workgroup to finish (lmv.comp, lmoe.comp's
// mode 0): the norm that follows a residual update (the next block's input) without a dispatch and a barrier of
// its own. a5: where not 0, the address of a uint counter (0 between dispatches); a6 w f32 [D]; a7 out f32 [D];
// u15 eps (float bits). Every workgroup counts itself in once its writes of y are done; the last one reads y f32
// [D] and writes out[i] = y[i] * (1 / sqrt(mean(y^2) + eps)) * w[i] (rmsnorm.comp's sums, at this kernel's
// workgroup size), then sets the counter back to 0. y must be written through F32C (coherent) before the call.
// Include after layer_reduce.glsl; call from every invocation (uniform control flow) at the end of main.
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer F32C { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) coherent buffer U32C { uint v[]; };
shared uint NT_LAST_;

void norm_tail(uint64_t ya, uint D) {
    uint64_t ca = pc.a[5];
    if (ca == 0ul) return;                                   // uniform
    memoryBarrierBuffer();
    barrier();
    uint nwg = gl_NumWorkGroups.x * gl_NumWorkGroups.y * gl_NumWorkGroups.z;
    if (gl_LocalInvocationIndex == 0u) NT_LAST_ = atomicAdd(U32C(ca).v[0], 1u) + 1u == nwg ? 1u : 0u;
    barrier();
    if (NT_LAST_ == 0u) return;                              // uniform
    memoryBarrierBuffer();
    uint t = gl_LocalInvocationIndex, WG = gl_WorkGroupSize.x;
    F32C Y = F32C(ya);
    F32 W = F32(pc.a[6]);
    F32 OUT = F32(pc.a[7]);
    float s = 0.0;
    for (uint i = t; i < D; i += WG) {
        float v = Y.v[i];
        s += v * v;
    }
    s = wg_sum(s);
    float inv = 1.0 / sqrt(s / float(D) + pcf(15u));
    for (uint i = t; i < D; i += WG) OUT.v[i] = (Y.v[i] * inv) * W.v[i];
    if (t == 0u) U32C(ca).v[0] = 0u;
}
