// ggml-common.h kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113} as
// four words of int8 bytes, picked by selects (a dynamically indexed array would sit in local memory).
float kv_iq4nl(uint q) {
    uint wd = q < 8u ? (q < 4u ? 0xBFAD9881u : 0xF6EADDCFu) : (q < 12u ? 0x26190D01u : 0x71594535u);
    return float(bitfieldExtract(int(wd), int(8u * (q & 3u)), 8));
}
vec4 kv4_lo(uint v) { return vec4(kv_iq4nl(v & 15u), kv_iq4nl((v >> 8) & 15u), kv_iq4nl((v >> 16) & 15u), kv_iq4nl((v >> 24) & 15u)); }
vec4 kv4_hi(uint v) { return vec4(kv_iq4nl((v >> 4) & 15u), kv_iq4nl((v >> 12) & 15u), kv_iq4nl((v >> 20) & 15u), kv_iq4nl(v >> 28)); }
