/* Pre-tokenization in native code: the splits that HF `tokenizers` makes for the 'gpt2',
 * 'smollm', 'llama3' and 'qwen2' pre-tokenizers of llama.cpp (edgellm/model/tokenizer.py), so
 * that the tokenizer's native path (bpe.c: el_bpe_encode_text) needs no HF tokenizer object.
 *
 * GPT-2's regex, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+,
 * matched leftmost, alternatives in order, as a hand-written scanner: at each position the first
 * alternative that matches gives the piece. The only backtracking in the regex is \s+(?!\S): a
 * whitespace run followed by a non-space gives up its last character (which then starts the
 * next piece, " word" or a lone "\n"); a run at the end of the text is one piece. 'smollm' first
 * isolates every \p{N} character, then applies the regex to each piece between them, each piece
 * being a text of its own (its end is an end for \s+(?!\S)). 'llama3' and 'qwen2' use their
 * own regex (el_llama3_match), with case-free contractions, an optional non-letter before a
 * letter run, and line breaks kept with the punctuation or whitespace before them.
 *
 * \s is Unicode White_Space, as Oniguruma (HF's regex engine) has it; \p{L}, \p{N}, \p{P} come from
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

static int el_is_crlf(uint32_t c) { return c == '\r' || c == '\n'; }

static int el_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

/* End of the llama3 regex's match at t[i] (qwen2's: one digit at a time, max_digits = 1):
 * (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
 *  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Every character starts some alternative (a letter, a number, another character, or
 * whitespace), so the text is cut into matches with no gaps. */
static int el_llama3_match(const uint32_t *t, int n, int i, int max_digits) {
    const uint32_t c = t[i];
    if (c == '\'' && i + 1 < n) {
        const uint32_t d = el_lower(t[i + 1]);
        if (d == 's' || d == 't' || d == 'm' || d == 'd') return i + 2;
        if (i + 2 < n) {
            const uint32_t e = el_lower(t[i + 2]);
            if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l')) return i + 3;
        }
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ */
    int k = -1;
    if (el_is_letter(c)) k = i;
    else if (!el_is_crlf(c) && !el_is_number(c) && i + 1 < n && el_is_letter(t[i + 1])) k = i + 1;
    if (k >= 0) {
        while (k < n && el_is_letter(t[k])) k++;
        return k;
    }
    if (el_is_number(c)) {                 /* \p{N}{1,max_digits} */
        int j = i + 1;
        while (j < n && j - i < max_digits && el_is_number(t[j])) j++;
        return j;
    }
    k = i + (c == ' ');                    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    if (k < n && el_is_other(t[k])) {
        while (k < n && el_is_other(t[k])) k++;
        while (k < n && el_is_crlf(t[k])) k++;
        return k;
    }
    int j = i;                             /* c is whitespace: its run is [i, j) */
    while (j < n && el_is_space(t[j])) j++;
    for (int e = j; e > i; e--)            /* \s*[\r\n]+: up to the run's last CR or LF */
        if (el_is_crlf(t[e - 1])) return e;
    return (j < n && j - i >= 2) ? j - 1 : j;   /* \s+(?!\S), else \s+ */
}

/* 'default' (llama.cpp's chain for a file that names no pre-tokenizer): each regex splits the
 * pieces of the one before, its matches and the text between them all kept as pieces:
 * [\p{P}\$\+<=>\^~\|]+, then GPT-2's regex (without its last \s+, which only joins a lone
 * whitespace character that is a piece on its own anyway), then \p{N}+, then [0-9][0-9][0-9]. */
static int el_is_punct(uint32_t c) {
    return c == '$' || c == '+' || c == '<' || c == '=' || c == '>' || c == '^' || c == '~' || c == '|' ||
           el_uni_in(el_uni_punct, EL_UNI_PUNCT_N, c);
}

typedef struct {
    const uint32_t *t;
    el_piece_fn emit;
    void *ctx;
} el_chain;

static void el_default_digits3(const el_chain *c, int a, int b) {
    int gap = a;
    for (int i = a; i < b;) {
        if (i + 3 <= b && c->t[i] - '0' < 10 && c->t[i + 1] - '0' < 10 && c->t[i + 2] - '0' < 10) {
            if (gap < i) c->emit(c->ctx, gap, i);
            c->emit(c->ctx, i, i + 3);
            i += 3;
            gap = i;
        } else {
            i++;
        }
    }
    if (gap < b) c->emit(c->ctx, gap, b);
}

static void el_default_numbers(const el_chain *c, int a, int b) {
    for (int i = a; i < b;) {
        const int num = el_is_number(c->t[i]);
        int j = i + 1;
        while (j < b && el_is_number(c->t[j]) == num) j++;
        el_default_digits3(c, i, j);
        i = j;
    }
}

static void el_default_split(const uint32_t *t, int n, el_piece_fn emit, void *ctx) {
    const el_chain c = {t, emit, ctx};
    for (int a = 0; a < n;) {
        const int punct = el_is_punct(t[a]);
        int b = a + 1;
        while (b < n && el_is_punct(t[b]) == punct) b++;
        for (int i = a; i < b;) {      /* GPT-2's regex within the piece */
            const int j = el_gpt2_match(t + a, b - a, i - a) + a;
            el_default_numbers(&c, i, j);
            i = j;
        }
        a = b;
    }
}

void el_pretok_split(int family, const uint32_t *t, int n, el_piece_fn emit, void *ctx) {
    if (family == EL_PRE_DEFAULT) {
        el_default_split(t, n, emit, ctx);
        return;
    }
    if (family == EL_PRE_LLAMA3 || family == EL_PRE_QWEN2) {
        const int max_digits = family == EL_PRE_LLAMA3 ? 3 : 1;
        for (int i = 0; i < n;) {
            const int j = el_llama3_match(t, n, i, max_digits);
            emit(ctx, i, j);
            i = j;
        }
        return;
    }
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
