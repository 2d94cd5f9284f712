// Kernels the runtime itself uses: the device's preferred work-group multiple is asked of a
// real kernel (OpenCL reports it per kernel, not per device).
__kernel void el_fill(__global float *out, const float value, const int n) {
    const int i = get_global_id(0);
    if (i < n) out[i] = value;
}
