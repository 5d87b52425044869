// Workgroup reductions of the whole-layer kernels (rmsnorm, topk, attn_dec): subgroup arithmetic, then one
// partial per subgroup in shared memory, summed by every invocation in subgroup order, so every invocation gets
// the same value and the result does not depend on which invocation asks. Correct at any subgroup size (the
// partials array holds one slot per invocation, enough for subgroups of one). Every invocation of the
// workgroup must call them (uniform control flow): they hold two barriers (the second lets the partials be
// reused at once).
shared float RED_[gl_WorkGroupSize.x];

float wg_sum(float v) {
    v = subgroupAdd(v);
    if (subgroupElect()) RED_[gl_SubgroupID] = v;
    barrier();
    float s = 0.0;
    for (uint i = 0u; i < gl_NumSubgroups; i++) s += RED_[i];
    barrier();
    return s;
}

float wg_max(float v) {
    v = subgroupMax(v);
    if (subgroupElect()) RED_[gl_SubgroupID] = v;
    barrier();
    float m = RED_[0];
    for (uint i = 1u; i < gl_NumSubgroups; i++) m = max(m, RED_[i]);
    barrier();
    return m;
}
