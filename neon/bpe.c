/* Byte-level BPE merges for the tokenizer (edgellm/model/bpe_native.py): the "model" half of a
 * GPT-2-style tokenizer, after the pre-tokenizer has cut the text into pieces and mapped their
 * bytes to GPT-2's printable characters.
 *
 * Why native: with HF `tokenizers`' BPE model SmolLM2's tokenizer (~49k tokens and merges) took
 * 80-100 ms of every load to build and 14.1 MB resident (x86). Here the tables are two
 * open-addressing hash tables over the tokens' code points: ~10 ms and 2.1 MB.
 *
 * Semantics (those of llama.cpp's llm_tokenizer_bpe and HF's BPE model): a piece starts as one
 * symbol per character; the adjacent pair with the lowest merge rank is merged, the leftmost such
 * pair first, until no adjacent pair has a merge. A character that is not a token (a vocabulary
 * may lack some of the 256 byte characters: SmolLM2 lacks 0x04, 0x13, 0xc0, ...) stays a symbol
 * that no pair merges across, and yields no id: llama.cpp's order. Dropping it before the merges
 * joined its neighbours (".\x13." gave one id for "..", llama.cpp two). ignore_merges (llama3):
 * a piece that is a whole token is that token. A pair listed twice keeps its first rank, as
 * llama.cpp does. Plain C: no SIMD, the same on every target (it is its own generic twin).
 *
 * Strings arrive as UTF-32 code points with int32 start offsets (string j is cp[starts[j] ..
 * starts[j + 1])), which is how Python hands over its str without a per-string loop.
 */
#include "edgellm_neon.h"
#include "el_pretok.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct el_bpe {
    const void *cp;          /* the tokens' code points (a copy): uint16_t when all are below 2^16, */
    int cp16;                /* else uint32_t. Byte-level vocabularies (GPT-2's characters, up to
                              * U+0143) then take half: SmolLM2's 332k, 1.27 -> 0.63 MiB resident */
    int32_t *start;          /* (n_tok + 1,) */
    int n_tok;
    int32_t *vslot;          /* vocab table: token id or -1; size vmask + 1 */
    uint32_t vmask;
    uint64_t *mkey;          /* merge table: (a << 32 | b) + 1, 0 = empty; size mmask + 1 */
    int32_t *mrank, *mnew;
    uint32_t mmask;
    int ignore_merges;
    int32_t *score_rank;     /* SentencePiece (el_spm_create): per token, by score; NULL for BPE */
    int32_t byte_id[256];    /* SentencePiece: the <0xNN> token of each byte, -1 if none */
    int32_t unk;             /* SentencePiece: the unknown token, -1 if none */
};

static uint32_t el_bpe_hash(const uint32_t *p, int n) {
    uint32_t h = 2166136261u;                           /* FNV-1a over the code points */
    for (int i = 0; i < n; i++) h = (h ^ p[i]) * 16777619u;
    return h ^ (h >> 15);
}

static uint64_t el_bpe_mix(uint64_t x) {               /* splitmix64's finaliser */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* slots for n keys at a load of at most 3/4. SmolLM2 (49k tokens, 49k merges: 2^16 slots each)
 * against a load of at most 1/2: resident 4.0 -> 2.75 MB with the code points, encoding 26k tokens
 * of text 3.0-3.3 -> 3.2-3.4 ms (longer probe runs for the pairs that have no merge). */
static uint32_t el_bpe_table_size(int n) {
    uint32_t s = 16;
    while ((uint64_t)3 * s < (uint64_t)4 * (uint32_t)n) s <<= 1;
    return s;
}

/* whether the stored code points from s on are p[0..n) */
static int el_bpe_same(const el_bpe *b, int32_t s, const uint32_t *p, int n) {
    if (!b->cp16) return memcmp((const uint32_t *)b->cp + s, p, (size_t)n * sizeof(uint32_t)) == 0;
    const uint16_t *q = (const uint16_t *)b->cp + s;
    for (int i = 0; i < n; i++)
        if (q[i] != p[i]) return 0;
    return 1;
}

/* the id of the token whose code points are p[0..n), or -1 */
static int32_t el_bpe_find(const el_bpe *b, const uint32_t *p, int n) {
    for (uint32_t i = el_bpe_hash(p, n) & b->vmask;; i = (i + 1) & b->vmask) {
        const int32_t id = b->vslot[i];
        if (id < 0) return -1;
        const int32_t s = b->start[id];
        if (b->start[id + 1] - s == n && el_bpe_same(b, s, p, n)) return id;
    }
}

static int el_bpe_merge_find(const el_bpe *b, int32_t a, int32_t c, int32_t *rank, int32_t *merged) {
    const uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)c) + 1;
    for (uint32_t i = (uint32_t)el_bpe_mix(key) & b->mmask;; i = (i + 1) & b->mmask) {
        if (b->mkey[i] == 0) return 0;
        if (b->mkey[i] == key) {
            *rank = b->mrank[i];
            *merged = b->mnew[i];
            return 1;
        }
    }
}

void el_bpe_destroy(el_bpe *b) {
    if (!b) return;
    free((void *)b->cp);
    free(b->start);
    free(b->vslot);
    free(b->mkey);
    free(b->mrank);
    free(b->mnew);
    free(b->score_rank);
    free(b);
}

el_bpe *el_bpe_create(const uint32_t *tok_cp, const int32_t *tok_start, int n_tok, const uint32_t *mrg_cp,
                      const int32_t *mrg_start, int n_mrg, int ignore_merges, int *err_kind, int *err_index) {
    int kind_dummy, index_dummy;
    if (!err_kind) err_kind = &kind_dummy;
    if (!err_index) err_index = &index_dummy;
    *err_kind = EL_BPE_EARG;
    *err_index = -1;
    if (!tok_cp || !tok_start || n_tok <= 0 || n_tok >= (1 << 30) || n_mrg < 0 || n_mrg >= (1 << 30) ||
        (n_mrg > 0 && (!mrg_cp || !mrg_start)))
        return NULL;
    for (int j = 0; j < n_tok; j++)
        if (tok_start[j] < 0 || tok_start[j + 1] < tok_start[j]) return NULL;
    for (int k = 0; k < n_mrg; k++)
        if (mrg_start[k] < 0 || mrg_start[k + 1] < mrg_start[k]) return NULL;
    *err_kind = EL_BPE_ENOMEM;
    el_bpe *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    const size_t n_cp = (size_t)tok_start[n_tok] - (size_t)tok_start[0];
    const uint32_t *src = tok_cp + tok_start[0];
    b->cp16 = 1;
    for (size_t i = 0; i < n_cp && b->cp16; i++) b->cp16 = src[i] < 0x10000u;
    void *cp = malloc((n_cp ? n_cp : 1) * (b->cp16 ? sizeof(uint16_t) : sizeof(uint32_t)));
    b->cp = cp;
    b->start = malloc(((size_t)n_tok + 1) * sizeof(int32_t));
    b->n_tok = n_tok;
    b->ignore_merges = ignore_merges != 0;
    const uint32_t vsize = el_bpe_table_size(n_tok), msize = el_bpe_table_size(n_mrg > 0 ? n_mrg : 1);
    b->vmask = vsize - 1;
    b->mmask = msize - 1;
    b->vslot = malloc(vsize * sizeof(int32_t));
    b->mkey = calloc(msize, sizeof(uint64_t));
    b->mrank = malloc(msize * sizeof(int32_t));
    b->mnew = malloc(msize * sizeof(int32_t));
    if (!cp || !b->start || !b->vslot || !b->mkey || !b->mrank || !b->mnew) {
        el_bpe_destroy(b);
        return NULL;
    }
    if (b->cp16)
        for (size_t i = 0; i < n_cp; i++) ((uint16_t *)cp)[i] = (uint16_t)src[i];
    else
        memcpy(cp, src, n_cp * sizeof(uint32_t));
    for (int j = 0; j <= n_tok; j++) b->start[j] = tok_start[j] - tok_start[0];
    memset(b->vslot, 0xff, vsize * sizeof(int32_t));
    for (int j = 0; j < n_tok; j++) {
        const uint32_t *p = src + b->start[j];
        const int n = b->start[j + 1] - b->start[j];
        if (el_bpe_find(b, p, n) >= 0) {        /* the caller rejects duplicates first; be safe */
            *err_kind = EL_BPE_EDUP;
            *err_index = j;
            el_bpe_destroy(b);
            return NULL;
        }
        uint32_t i = el_bpe_hash(p, n) & b->vmask;
        while (b->vslot[i] >= 0) i = (i + 1) & b->vmask;
        b->vslot[i] = j;
    }
    for (int k = 0; k < n_mrg; k++) {
        const uint32_t *m = mrg_cp + mrg_start[k];
        const int len = mrg_start[k + 1] - mrg_start[k];
        /* "a b": split at the first space after position 0 (a token may start with a space) */
        int sp = -1;
        for (int i = 1; i < len; i++)
            if (m[i] == ' ') {
                sp = i;
                break;
            }
        int32_t a = -1, c = -1, merged = -1;
        *err_index = k;
        if (sp < 0 || sp == len - 1) {
            *err_kind = EL_BPE_ESPLIT;
        } else if ((a = el_bpe_find(b, m, sp)) < 0) {
            *err_kind = EL_BPE_ELEFT;
        } else if ((c = el_bpe_find(b, m + sp + 1, len - sp - 1)) < 0) {
            *err_kind = EL_BPE_ERIGHT;
        } else {
            /* the merged token's code points: the merge without its space */
            uint32_t stack_buf[64], *joined = stack_buf;
            if (len - 1 > 64 && !(joined = malloc((size_t)(len - 1) * sizeof(uint32_t)))) {
                *err_kind = EL_BPE_ENOMEM;
                el_bpe_destroy(b);
                return NULL;
            }
            memcpy(joined, m, (size_t)sp * sizeof(uint32_t));
            memcpy(joined + sp, m + sp + 1, (size_t)(len - sp - 1) * sizeof(uint32_t));
            merged = el_bpe_find(b, joined, len - 1);
            if (joined != stack_buf) free(joined);
            if (merged < 0) *err_kind = EL_BPE_EMERGED;
        }
        if (merged < 0) {
            el_bpe_destroy(b);
            return NULL;
        }
        const uint64_t key = ((uint64_t)(uint32_t)a << 32 | (uint32_t)c) + 1;
        uint32_t i = (uint32_t)el_bpe_mix(key) & b->mmask;
        while (b->mkey[i] != 0 && b->mkey[i] != key) i = (i + 1) & b->mmask;
        if (b->mkey[i] == 0) {                  /* a pair listed again keeps its first rank */
            b->mkey[i] = key;
            b->mrank[i] = k;
            b->mnew[i] = merged;
        }
    }
    *err_kind = 0;
    *err_index = -1;
    return b;
}

int el_bpe_token_id(const el_bpe *b, const uint32_t *cp, int n) {
    if (!b || n < 0 || (n > 0 && !cp)) return EL_EINVAL;
    return el_bpe_find(b, cp, n);
}

/* ---- encoding --------------------------------------------------------------------------------- */

/* A merge candidate, popped lowest key first, the leftmost among equal keys: the merge's rank
 * (BPE) or the merged token's score rank (SentencePiece: the higher the score, the lower the
 * rank, equal scores equal ranks). a, c: the pair's ids (BPE) or a: the pair's characters when
 * pushed (SentencePiece). One heap for both: forced inline, since with its two callers GCC kept
 * it out of line and encoding 27k tokens took ~6% longer. */
typedef struct {
    int32_t key;
    int32_t left, right, a, c, merged;
} el_bpe_cand;

static int el_bpe_less(const el_bpe_cand *x, const el_bpe_cand *y) {
    return x->key < y->key || (x->key == y->key && x->left < y->left);
}

static inline __attribute__((always_inline)) void el_bpe_push(el_bpe_cand *h, int *n, el_bpe_cand c) {
    int i = (*n)++;
    while (i > 0) {
        const int p = (i - 1) / 2;
        if (!el_bpe_less(&c, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static inline __attribute__((always_inline)) el_bpe_cand el_bpe_pop(el_bpe_cand *h, int *n) {
    const el_bpe_cand top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && el_bpe_less(&h[c + 1], &h[c])) c++;
        if (!el_bpe_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

typedef struct {
    int32_t id, prev, next;   /* id -1: merged away */
} el_bpe_sym;

static void el_bpe_pair(const el_bpe *b, const el_bpe_sym *s, int left, el_bpe_cand *h, int *nh) {
    if (left < 0) return;
    const int right = s[left].next;
    if (right < 0 || s[left].id < 0 || s[right].id < 0) return;   /* a character that is not a token */
    el_bpe_cand c = {.left = left, .right = right, .a = s[left].id, .c = s[right].id};
    int32_t rank;
    if (el_bpe_merge_find(b, c.a, c.c, &rank, &c.merged)) {
        c.key = rank;
        el_bpe_push(h, nh, c);
    }
}

/* One piece p[0..n) -> its ids at out + *n_out (at most n of them) */
static void el_bpe_piece(const el_bpe *b, const uint32_t *p, int n, el_bpe_sym *s, el_bpe_cand *h, int32_t *out,
                         int *n_out) {
    if (b->ignore_merges) {
        const int32_t id = el_bpe_find(b, p, n);
        if (id >= 0) {
            out[(*n_out)++] = id;
            return;
        }
    }
    int first = -1, last = -1;
    for (int i = 0; i < n; i++) {
        s[i].id = el_bpe_find(b, p + i, 1);   /* -1: not a token, a barrier to merges */
        s[i].prev = last;
        s[i].next = -1;
        if (last >= 0) s[last].next = i;
        else first = i;
        last = i;
    }
    int nh = 0;
    for (int i = first; i >= 0; i = s[i].next) el_bpe_pair(b, s, i, h, &nh);
    while (nh > 0) {
        const el_bpe_cand c = el_bpe_pop(h, &nh);
        /* stale: one side was merged since, or no longer holds the pair's ids */
        if (s[c.left].id != c.a || s[c.right].id != c.c || s[c.left].next != c.right) continue;
        s[c.left].id = c.merged;
        s[c.right].id = -1;
        s[c.left].next = s[c.right].next;
        if (s[c.right].next >= 0) s[s[c.right].next].prev = c.left;
        el_bpe_pair(b, s, s[c.left].prev, h, &nh);
        el_bpe_pair(b, s, c.left, h, &nh);
    }
    for (int i = first; i >= 0; i = s[i].next)
        if (s[i].id >= 0) out[(*n_out)++] = s[i].id;
}

int el_bpe_encode(const el_bpe *b, const uint32_t *cp, const int32_t *piece_start, int n_pieces, int32_t *out,
                  int cap) {
    if (!b || n_pieces < 0 || (n_pieces > 0 && (!cp || !piece_start)) || cap < 0 || (cap > 0 && !out))
        return EL_EINVAL;
    int longest = 0;
    for (int k = 0; k < n_pieces; k++) {
        const int n = piece_start[k + 1] - piece_start[k];
        if (piece_start[k] < 0 || n < 0) return EL_EINVAL;
        longest = n > longest ? n : longest;
    }
    /* a piece yields at most one id per character */
    if (n_pieces > 0 && (int64_t)piece_start[n_pieces] - piece_start[0] > cap) return EL_EINVAL;
    /* each merge pushes at most two candidates: n - 1 at the start, 2 (n - 1) after */
    el_bpe_sym *s = malloc(((size_t)longest + 1) * sizeof *s);
    el_bpe_cand *h = malloc(((size_t)3 * longest + 1) * sizeof *h);
    if (!s || !h) {
        free(s);
        free(h);
        return EL_ENOMEM;
    }
    int n_out = 0;
    for (int k = 0; k < n_pieces; k++)
        el_bpe_piece(b, cp + piece_start[k], piece_start[k + 1] - piece_start[k], s, h, out, &n_out);
    free(s);
    free(h);
    return n_out;
}

/* ---- text: pre-tokenized here ------------------------------------------------------------------ */

typedef struct {
    const el_bpe *b;
    const uint32_t *t;
    uint32_t byte_char[256];     /* GPT-2's byte -> printable character map */
    uint32_t *mapped;            /* a piece's bytes as those characters */
    el_bpe_sym *s;
    el_bpe_cand *h;
    int room;                    /* characters the three scratch arrays hold */
    int32_t *out;
    int n_out, err;
} el_text_ctx;

static int el_utf8_len(uint32_t u) { return u < 0x80 ? 1 : u < 0x800 ? 2 : u < 0x10000 ? 3 : 4; }

/* u's UTF-8 bytes into by; returns how many (u is a scalar value: checked by the callers) */
static int el_utf8(uint32_t u, uint8_t by[4]) {
    const int k = el_utf8_len(u);
    if (k == 1) {
        by[0] = (uint8_t)u;
        return 1;
    }
    for (int j = k - 1; j > 0; j--, u >>= 6) by[j] = (uint8_t)(0x80 | (u & 0x3F));
    by[0] = (uint8_t)((0xF00 >> k) | u);      /* 0xC0, 0xE0 or 0xF0 lead byte */
    return k;
}

static void el_text_piece(void *vctx, int a, int b) {
    el_text_ctx *c = vctx;
    if (c->err) return;
    int need = 0;                      /* the piece's UTF-8 bytes: one symbol each */
    for (int i = a; i < b; i++) need += el_utf8_len(c->t[i]);
    if (need > c->room) {
        const int room = need > 2 * c->room ? need : 2 * c->room;
        uint32_t *m = realloc(c->mapped, (size_t)room * sizeof *m);
        if (m) c->mapped = m;
        el_bpe_sym *s = m ? realloc(c->s, (size_t)room * sizeof *s) : NULL;
        if (s) c->s = s;
        el_bpe_cand *h = s ? realloc(c->h, ((size_t)3 * room + 1) * sizeof *h) : NULL;
        if (!h) {
            c->err = EL_ENOMEM;
            return;
        }
        c->h = h;
        c->room = room;
    }
    int m = 0;
    for (int i = a; i < b; i++) {     /* UTF-8 bytes, each as its byte character */
        const uint32_t u = c->t[i];
        uint8_t by[4];
        const int k = el_utf8(u, by);
        for (int j = 0; j < k; j++) c->mapped[m++] = c->byte_char[by[j]];
    }
    el_bpe_piece(c->b, c->mapped, m, c->s, c->h, c->out, &c->n_out);
}

int el_bpe_encode_text(const el_bpe *b, int family, const uint32_t *cp, int n, int32_t *out, int cap) {
    if (!b || n < 0 || (n > 0 && (!cp || !out)) || cap < 0 || (int64_t)4 * n > cap) return EL_EINVAL;
    if (family < EL_PRE_GPT2 || family > EL_PRE_DEFAULT) return EL_EUNSUPPORTED;
    for (int i = 0; i < n; i++)
        if (cp[i] > 0x10FFFF || (cp[i] >= 0xD800 && cp[i] <= 0xDFFF)) return EL_EINVAL;
    el_text_ctx c = {.b = b, .t = cp, .out = out};
    /* bytes_to_unicode: printable Latin-1 bytes are themselves, the other 68 are 256 + k in order */
    for (int v = 0, k = 0; v < 256; v++) {
        const int printable = (v >= '!' && v <= '~') || (v >= 0xA1 && v <= 0xAC) || (v >= 0xAE && v <= 0xFF);
        c.byte_char[v] = printable ? (uint32_t)v : (uint32_t)(256 + k++);
    }
    el_pretok_split(family, cp, n, el_text_piece, &c);
    free(c.mapped);
    free(c.s);
    free(c.h);
    return c.err ? c.err : c.n_out;
}

/* ---- SentencePiece-style vocabularies (llama.cpp's llm_tokenizer_spm) -------------------------- */

/* A vocabulary of tokens with scores, no merge list: two adjacent symbols merge when their
 * concatenated text is a token, the highest score first, the leftmost among equals; a final
 * symbol that is not a token (one character missing from the vocabulary) becomes its UTF-8
 * bytes' <0xNN> tokens (found by their text), or the unknown token where one is missing. Same heap as the BPE merges,
 * keyed by the merged token's score rank, the pair's merged id found by text instead of in a
 * merge table. */
typedef struct {
    float score;
    int32_t id;
} el_scored;

/* highest score first, NaN last */
static int el_by_score(const void *x, const void *y) {
    const float a = ((const el_scored *)x)->score, b = ((const el_scored *)y)->score;
    if (a == b || (a != a && b != b)) return 0;
    if (a != a) return 1;
    if (b != b) return -1;
    return a > b ? -1 : 1;
}

el_bpe *el_spm_create(const uint32_t *tok_cp, const int32_t *tok_start, int n_tok, const float *scores, int unk,
                      int *err_kind, int *err_index) {
    if (!scores || unk >= n_tok) {
        if (err_kind) *err_kind = EL_BPE_EARG;
        return NULL;
    }
    el_bpe *b = el_bpe_create(tok_cp, tok_start, n_tok, NULL, NULL, 0, 0, err_kind, err_index);
    if (!b) return NULL;
    b->score_rank = malloc((size_t)n_tok * sizeof(int32_t));
    el_scored *order = malloc((size_t)n_tok * sizeof *order);
    if (!b->score_rank || !order) {
        free(order);
        if (err_kind) *err_kind = EL_BPE_ENOMEM;
        el_bpe_destroy(b);
        return NULL;
    }
    for (int i = 0; i < n_tok; i++) order[i] = (el_scored){scores[i], i};
    qsort(order, (size_t)n_tok, sizeof *order, el_by_score);
    for (int i = 0, r = 0; i < n_tok; i++) {   /* equal scores, equal ranks */
        if (i > 0 && el_by_score(&order[i - 1], &order[i]) != 0) r = i;
        b->score_rank[order[i].id] = r;
    }
    free(order);
    for (int v = 0; v < 256; v++) {      /* the byte tokens, by their text "<0xNN>" */
        static const char hex[] = "0123456789ABCDEF";
        const uint32_t text[6] = {'<', '0', 'x', (uint32_t)hex[v >> 4], (uint32_t)hex[v & 15], '>'};
        b->byte_id[v] = el_bpe_find(b, text, 6);
    }
    b->unk = unk < 0 ? -1 : unk;
    return b;
}

/* symbol i spans characters [i, end[i]); prev/next link the live ones */
static void el_spm_pair(const el_bpe *b, const uint32_t *cp, const int32_t *end, const int32_t *next, int left,
                        el_bpe_cand *h, int *nh) {
    if (left < 0 || next[left] < 0) return;
    const int right = next[left], len = end[right] - left;
    const int32_t id = el_bpe_find(b, cp + left, len);
    if (id >= 0) el_bpe_push(h, nh, (el_bpe_cand){b->score_rank[id], left, right, len, -1, id});
}

int el_spm_encode(const el_bpe *b, const uint32_t *cp, int n, int32_t *out, int cap) {
    if (!b || !b->score_rank || n < 0 || (n > 0 && (!cp || !out)) || cap < 0 || (int64_t)4 * n > cap) return EL_EINVAL;
    for (int i = 0; i < n; i++)
        if (cp[i] > 0x10FFFF || (cp[i] >= 0xD800 && cp[i] <= 0xDFFF)) return EL_EINVAL;
    if (n == 0) return 0;
    int32_t *end = malloc((size_t)n * sizeof(int32_t)), *prev = malloc((size_t)n * sizeof(int32_t));
    int32_t *next = malloc((size_t)n * sizeof(int32_t));
    el_bpe_cand *h = malloc(((size_t)3 * n + 1) * sizeof *h);
    if (!end || !prev || !next || !h) {
        free(end), free(prev), free(next), free(h);
        return EL_ENOMEM;
    }
    for (int i = 0; i < n; i++) end[i] = i + 1, prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
    int nh = 0;
    for (int i = 0; i < n - 1; i++) el_spm_pair(b, cp, end, next, i, h, &nh);
    while (nh > 0) {
        const el_bpe_cand c = el_bpe_pop(h, &nh);
        /* stale: either side merged since (its span changed), or no longer neighbours */
        if (end[c.left] < 0 || end[c.right] < 0 || next[c.left] != c.right || end[c.right] - c.left != c.a)
            continue;
        end[c.left] = end[c.right];
        end[c.right] = -1;
        next[c.left] = next[c.right];
        if (next[c.right] >= 0) prev[next[c.right]] = c.left;
        el_spm_pair(b, cp, end, next, prev[c.left], h, &nh);
        el_spm_pair(b, cp, end, next, c.left, h, &nh);
    }
    int n_out = 0;
    for (int i = 0; i >= 0; i = next[i]) {
        const int32_t id = el_bpe_find(b, cp + i, end[i] - i);
        if (id >= 0) {
            out[n_out++] = id;
            continue;
        }
        /* one character missing from the vocabulary: its UTF-8 bytes (llama.cpp's byte fallback) */
        const uint32_t u = cp[i];
        uint8_t by[4];
        const int k = el_utf8(u, by);
        for (int j = 0; j < k; j++) {
            const int32_t bid = b->byte_id[by[j]] >= 0 ? b->byte_id[by[j]] : b->unk;
            if (bid >= 0) out[n_out++] = bid;
        }
    }
    free(end), free(prev), free(next), free(h);
    return n_out;
}
