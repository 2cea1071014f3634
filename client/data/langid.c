/* langid.c - the word lists into hashed character n-grams (langid.h). */
#include "data/langid.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const struct {
    const char *lang, *file, *package;
} langs[] = {
    {"english", "american-english", "wamerican"}, {"german", "ngerman", "wngerman"},
    {"french", "french", "wfrench"},              {"spanish", "spanish", "wspanish"},
    {"italian", "italian", "witalian"},           {"dutch", "dutch", "wdutch"},
    {"portuguese", "portuguese", "wportuguese"},  {"swedish", "swedish", "wswedish"},
    {"norwegian", "bokmaal", "wnorwegian"},       {"danish", "danish", "wdanish"},
    {"polish", "polish", "wpolish"},
};
#define N_LANGS ((int)(sizeof(langs) / sizeof(langs[0])))

static uint64_t fnv64(const char *s, size_t n)
{
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

int langid_word_ids(const char *word, size_t len, int64_t rows, int64_t *out)
{
    char buf[LANGID_WORD_MAX + 2];
    size_t bl = 0;
    buf[bl++] = '<';
    memcpy(buf + bl, word, len);
    bl += len;
    buf[bl++] = '>';
    /* where each character (UTF-8 code point) starts, and the end */
    size_t start[LANGID_WORD_MAX + 3];
    int nc = 0;
    for (size_t i = 0; i < bl; i++)
        if (((unsigned char)buf[i] & 0xC0) != 0x80)
            start[nc++] = i;
    start[nc] = bl;
    int k = 0;
    for (int n = LANGID_MIN_N; n <= LANGID_MAX_N; n++)
        for (int i = 0; i + n <= nc; i++) {
            uint32_t h = 2166136261u;
            for (size_t b = start[i]; b < start[i + n]; b++) {
                h ^= (uint32_t)(int8_t)buf[b];
                h *= 16777619u;
            }
            out[k++] = (int64_t)(h % (uint64_t)rows);
        }
    return k;
}

typedef struct cand {
    uint64_t h;
    char *word; /* malloc'd */
    uint8_t len, lang;
} cand;

static int by_hash(const void *a, const void *b)
{
    uint64_t x = ((const cand *)a)->h, y = ((const cand *)b)->h;
    return x < y ? -1 : x > y;
}

static int by_word(const void *a, const void *b)
{
    const cand *x = a, *y = b;
    int c = x->len != y->len ? (x->len < y->len ? -1 : 1) : memcmp(x->word, y->word, x->len);
    return c ? c : (x->lang > y->lang) - (x->lang < y->lang);
}

static int by_hash_lang(const void *a, const void *b)
{
    int c = by_hash(a, b);
    return c ? c : (((const cand *)a)->lang > ((const cand *)b)->lang) - (((const cand *)a)->lang < ((const cand *)b)->lang);
}

/* A line of a list: its hash and where it is in the file's text. */
typedef struct line_ref {
    uint64_t h;
    uint32_t at;
    uint8_t len;
} line_ref;

static int ref_by_hash(const void *a, const void *b)
{
    uint64_t x = ((const line_ref *)a)->h, y = ((const line_ref *)b)->h;
    return x < y ? -1 : x > y;
}

/* The whole file into *text (malloc'd), *len bytes: 0, or -1 with errno. */
static int slurp(const char *path, char **text, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap)
            break;
        if (cap >= ((size_t)1 << 31)) { /* a word list past 2 GiB: not one */
            free(buf);
            buf = NULL;
            errno = EFBIG;
            break;
        }
        char *nb = realloc(buf, cap * 2);
        if (!nb) {
            free(buf);
            buf = NULL;
            errno = ENOMEM;
            break;
        }
        buf = nb;
        cap *= 2;
    }
    int bad = ferror(f);
    fclose(f);
    if (!buf || bad) {
        free(buf);
        if (bad)
            errno = EIO;
        return -1;
    }
    *text = buf;
    *len = n;
    return 0;
}

/* One list's per_lang words of smallest hash, appended to *all. */
static int read_list(const char *path, int lang, int64_t per_lang, cand **all, int64_t *n, int64_t *cap,
                     char *err, size_t errlen)
{
    char *text;
    size_t len;
    if (slurp(path, &text, &len) != 0) {
        snprintf(err, errlen, "langid: %s: %s (install Debian's %s: make deps)", path, strerror(errno),
                 langs[lang].package);
        return -1;
    }
    size_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    line_ref *refs = malloc(sizeof(line_ref) * lines);
    int64_t nr = 0;
    for (size_t i = 0; refs && i < len;) {
        size_t e = i;
        while (e < len && text[e] != '\n')
            e++;
        size_t l = e;
        if (l > i && text[l - 1] == '\r')
            l--;
        size_t wl = l - i;
        if (wl >= 2 && wl <= LANGID_WORD_MAX && !memchr(text + i, ' ', wl) && !memchr(text + i, '\t', wl))
            refs[nr++] = (line_ref){fnv64(text + i, wl), (uint32_t)i, (uint8_t)wl};
        i = e + 1;
    }
    int rc = refs ? 0 : -1;
    if (rc == 0) {
        qsort(refs, (size_t)nr, sizeof(line_ref), ref_by_hash);
        int64_t keep = nr < per_lang ? nr : per_lang;
        if (*n + keep > *cap) {
            int64_t nc = *cap ? *cap : 65536;
            while (nc < *n + keep)
                nc *= 2;
            cand *na = realloc(*all, sizeof(cand) * (size_t)nc);
            if (!na)
                rc = -1;
            else {
                *all = na;
                *cap = nc;
            }
        }
        for (int64_t k = 0; rc == 0 && k < keep; k++) {
            cand *c = &(*all)[*n];
            *c = (cand){refs[k].h, malloc(refs[k].len), refs[k].len, (uint8_t)lang};
            if (!c->word) {
                rc = -1;
                break;
            }
            memcpy(c->word, text + refs[k].at, refs[k].len);
            (*n)++;
        }
    }
    if (rc != 0)
        snprintf(err, errlen, "langid: out of memory reading %s", path);
    free(refs);
    free(text);
    return rc;
}

/* What langid_dataset.mem holds. */
typedef struct langid_mem {
    cand *all;
    int64_t n_all;
    int64_t *off[2], *ids[2];
    uint8_t *labels[2];
    char **words[2];
    char *text; /* the words, NUL-terminated, back to back */
} langid_mem;

static void mem_free(langid_mem *m)
{
    if (!m)
        return;
    for (int s = 0; s < 2; s++) {
        free(m->off[s]);
        free(m->ids[s]);
        free(m->labels[s]);
        free(m->words[s]);
    }
    for (int64_t i = 0; i < m->n_all; i++)
        free(m->all[i].word);
    free(m->all);
    free(m->text);
    free(m);
}

void langid_free(langid_dataset *ds)
{
    mem_free(ds->mem);
    memset(ds, 0, sizeof(*ds));
}

static int build_split(langid_mem *m, int s, const cand *c, int64_t n, char **text_at, int64_t rows)
{
    m->off[s] = malloc(sizeof(int64_t) * (size_t)(n + 1));
    m->ids[s] = malloc(sizeof(int64_t) * (size_t)(n ? n : 1) * LANGID_MAX_IDS);
    m->labels[s] = malloc((size_t)(n ? n : 1));
    m->words[s] = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    if (!m->off[s] || !m->ids[s] || !m->labels[s] || !m->words[s])
        return -1;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        m->off[s][i] = k;
        k += langid_word_ids(c[i].word, c[i].len, rows, m->ids[s] + k);
        m->labels[s][i] = c[i].lang;
        memcpy(*text_at, c[i].word, c[i].len);
        (*text_at)[c[i].len] = '\0';
        m->words[s][i] = *text_at;
        *text_at += c[i].len + 1;
    }
    m->off[s][n] = k;
    return 0;
}

int langid_load(const char *dir, int64_t rows, int64_t per_lang, langid_dataset *ds, char *err, size_t errlen)
{
    memset(ds, 0, sizeof(*ds));
    if (rows < 1 || rows > ((int64_t)1 << 40) || per_lang < 1) {
        snprintf(err, errlen, "langid: rows must be 1 to 2^40 and the words per language positive");
        return -1;
    }
    langid_mem *m = calloc(1, sizeof(*m));
    if (!m) {
        snprintf(err, errlen, "langid: out of memory");
        return -1;
    }
    int64_t cap = 0;
    for (int l = 0; l < N_LANGS; l++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir ? dir : LANGID_DICT_DIR, langs[l].file);
        if (read_list(path, l, per_lang, &m->all, &m->n_all, &cap, err, errlen) != 0) {
            mem_free(m);
            return -1;
        }
    }
    /* a word in two languages' selections: dropped from both */
    qsort(m->all, (size_t)m->n_all, sizeof(cand), by_word);
    int64_t w = 0;
    for (int64_t i = 0; i < m->n_all;) {
        int64_t j = i + 1;
        while (j < m->n_all && m->all[j].len == m->all[i].len && !memcmp(m->all[j].word, m->all[i].word, m->all[i].len))
            j++;
        if (j - i == 1)
            m->all[w++] = m->all[i];
        else
            for (int64_t k = i; k < j; k++)
                free(m->all[k].word);
        i = j;
    }
    m->n_all = w;
    qsort(m->all, (size_t)m->n_all, sizeof(cand), by_hash_lang);
    /* the split by word: test first in a copy, then train */
    cand *split = malloc(sizeof(cand) * (size_t)(m->n_all ? m->n_all : 1));
    size_t text_len = 0;
    for (int64_t i = 0; i < m->n_all; i++)
        text_len += m->all[i].len + 1u;
    m->text = malloc(text_len ? text_len : 1);
    if (!split || !m->text) {
        free(split);
        mem_free(m);
        snprintf(err, errlen, "langid: out of memory");
        return -1;
    }
    int64_t nt = 0;
    for (int64_t i = 0; i < m->n_all; i++)
        if ((m->all[i].h >> 32) % 10 == 0)
            split[nt++] = m->all[i];
    int64_t ntr = 0;
    for (int64_t i = 0; i < m->n_all; i++)
        if ((m->all[i].h >> 32) % 10 != 0)
            split[nt + ntr++] = m->all[i];
    char *at = m->text;
    int bad = build_split(m, 1, split, nt, &at, rows) || build_split(m, 0, split + nt, ntr, &at, rows);
    free(split);
    if (bad) {
        mem_free(m);
        snprintf(err, errlen, "langid: out of memory");
        return -1;
    }
    ds->n_langs = N_LANGS;
    for (int l = 0; l < N_LANGS; l++) {
        ds->lang[l] = langs[l].lang;
        ds->file[l] = langs[l].file;
    }
    ds->rows = rows;
    ds->train = (langid_split){ntr, m->off[0], m->ids[0], m->labels[0], (const char *const *)m->words[0]};
    ds->test = (langid_split){nt, m->off[1], m->ids[1], m->labels[1], (const char *const *)m->words[1]};
    ds->mem = m;
    return 0;
}
