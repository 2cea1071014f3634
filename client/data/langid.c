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

/* One list's per_lang words of smallest hash, appended to *all. */
static int read_list(const char *path, int lang, int64_t per_lang, cand **all, int64_t *n, int64_t *cap,
                     char *err, size_t errlen)
{
    FILE *f = fopen(path, "r");
    if (!f) {
        snprintf(err, errlen, "langid: %s: %s (install Debian's %s: make deps)", path, strerror(errno),
                 langs[lang].package);
        return -1;
    }
    cand *mine = NULL;
    int64_t nm = 0, cm = 0;
    char line[512];
    int rc = 0;
    while (fgets(line, sizeof(line), f)) {
        size_t len = strcspn(line, "\r\n");
        line[len] = '\0';
        if (len < 2 || len > LANGID_WORD_MAX || strchr(line, ' ') || strchr(line, '\t'))
            continue;
        if (nm == cm) {
            cm = cm ? 2 * cm : 4096;
            cand *nc = realloc(mine, sizeof(*nc) * (size_t)cm);
            if (!nc) {
                rc = -1;
                break;
            }
            mine = nc;
        }
        mine[nm++] = (cand){fnv64(line, len), NULL, (uint8_t)len, (uint8_t)lang};
        /* the word itself only for those kept: hold it for now */
        if (!(mine[nm - 1].word = malloc(len))) {
            rc = -1;
            break;
        }
        memcpy(mine[nm - 1].word, line, len);
    }
    fclose(f);
    if (rc == 0) {
        qsort(mine, (size_t)nm, sizeof(cand), by_hash);
        int64_t keep = nm < per_lang ? nm : per_lang;
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
        if (rc == 0) {
            memcpy(*all + *n, mine, sizeof(cand) * (size_t)keep);
            *n += keep;
            for (int64_t i = keep; i < nm; i++)
                free(mine[i].word);
        }
    }
    if (rc != 0) {
        for (int64_t i = 0; i < nm; i++)
            free(mine[i].word);
        snprintf(err, errlen, "langid: out of memory reading %s", path);
    }
    free(mine);
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
