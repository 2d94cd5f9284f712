/* The GGUF parser's hot loop in native code (edgellm/model/gguf_file.py): walking a string
 * array's u64 lengths to find where each string starts. SmolLM2's vocabulary and merges are
 * ~98k strings, and the Python walk (one struct.unpack_from per string) took ~9.5 ms of every
 * load, about half of parsing the file. Validation stays the parser's: this returns 1 at the
 * first length that is past the end of the buffer or over max_len, and the parser then walks
 * the array itself to name that string in its error. Plain C. */
#include "edgellm_neon.h"

#include <string.h>

static uint64_t el_le64(const uint8_t *p) {       /* GGUF is little-endian whatever the host */
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

int el_gguf_string_walk(const uint8_t *buf, uint64_t size, uint64_t pos, int64_t n, uint64_t max_len,
                        int64_t *starts, uint64_t *end) {
    if (!buf || !end || n < 0 || (n > 0 && !starts) || pos > size) return EL_EINVAL;
    const uint64_t base = pos;
    for (int64_t j = 0; j < n; j++) {
        if (size - pos < 8) return 1;
        const uint64_t len = el_le64(buf + pos);
        if (len > max_len || len > size - pos - 8) return 1;
        starts[j] = (int64_t)(pos + 8 - base);
        pos += 8 + len;
    }
    *end = pos;
    return EL_OK;
}
