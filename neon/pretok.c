/* GPT-2-family pre-tokenization in native code: the splits that HF `tokenizers` makes for the
 * 'gpt2' and 'smollm' pre-tokenizers of llama.cpp (edgellm/model/tokenizer.py), so that the
 * tokenizer's native path (bpe.c: el_bpe_encode_text) needs no HF tokenizer object at all.
 *
 * GPT-2's regex, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+,
 * matched leftmost, alternatives in order, as a hand-written scanner: at each position the first
 * alternative that matches gives the piece. The only backtracking in the regex is \s+(?!\S): a
 * whitespace run followed by a non-space gives up its last character (which then starts the
 * next piece, " word" or a lone "\n"); a run at the end of the text is one piece. 'smollm' first
 * isolates every \p{N} character, then applies the regex to each piece between them, each piece
 * being a text of its own (its end is an end for \s+(?!\S)).
 *
 * \s is Unicode White_Space, as Oniguruma (HF's regex engine) has it; \p{L} and \p{N} come from
 * el_unicode_tables.h, read from that same engine (tools/gen_unicode_tables.py). Plain C.
 */
#include "edgellm_neon.h"
#include "el_pretok.h"
#include "el_unicode_tables.h"

static int el_uni_in(const uint32_t (*t)[2], int n, uint32_t c) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        const int mid = (lo + hi) / 2;
        if (c < t[mid][0]) hi = mid - 1;
        else if (c > t[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static int el_is_letter(uint32_t c) {
    if (c < 0x80) return (c | 0x20) - 'a' < 26;
    return el_uni_in(el_uni_letter, EL_UNI_LETTER_N, c);
}

static int el_is_number(uint32_t c) {
    if (c < 0x80) return c - '0' < 10;
    return el_uni_in(el_uni_number, EL_UNI_NUMBER_N, c);
}

static int el_is_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

static int el_is_other(uint32_t c) { return !el_is_space(c) && !el_is_letter(c) && !el_is_number(c); }

/* End of the GPT-2 regex's match at t[i] (i < n); t[n] is the end of the text */
static int el_gpt2_match(const uint32_t *t, int n, int i) {
    const uint32_t c = t[i];
    if (c == '\'' && i + 1 < n) {
        const uint32_t d = t[i + 1];
        if (d == 's' || d == 't' || d == 'm' || d == 'd') return i + 2;
        if (i + 2 < n && ((d == 'r' && t[i + 2] == 'e') || (d == 'v' && t[i + 2] == 'e') ||
                          (d == 'l' && t[i + 2] == 'l')))
            return i + 3;
    }
    const int k = i + (c == ' ');     /* ' ?' before each of the three classes */
    if (k < n) {
        int (*const cls[3])(uint32_t) = {el_is_letter, el_is_number, el_is_other};
        for (int a = 0; a < 3; a++)
            if (cls[a](t[k])) {
                int j = k + 1;
                while (j < n && cls[a](t[j])) j++;
                return j;
            }
    }
    int j = i + 1;                     /* c is whitespace: every other character matched above */
    while (j < n && el_is_space(t[j])) j++;
    return (j < n && j - i >= 2) ? j - 1 : j;
}

void el_pretok_split(int family, const uint32_t *t, int n, el_piece_fn emit, void *ctx) {
    for (int a = 0; a < n;) {
        int b = n;
        if (family == EL_PRE_SMOLLM) {
            if (el_is_number(t[a])) {  /* each number character on its own */
                emit(ctx, a, a + 1);
                a++;
                continue;
            }
            for (b = a + 1; b < n && !el_is_number(t[b]); b++) {}
        }
        for (int i = a; i < b;) {
            const int j = el_gpt2_match(t + a, b - a, i - a) + a;
            emit(ctx, i, j);
            i = j;
        }
        a = b;
    }
}
