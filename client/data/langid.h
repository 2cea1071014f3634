/* langid.h - language identification of single words from Debian's word
 * lists (/usr/share/dict: wamerican, wngerman, wfrench, ...): each word's
 * character n-grams hashed into the rows of an embedding table,
 * fastText-style, with its language as the label.
 *
 * The data, deterministic from the files alone:
 * - per language, the per_lang words (2 to 32 bytes, no space) whose 64-bit
 *   FNV-1a hash is smallest (all of them when the list is shorter);
 * - a word found in more than one language's selection is dropped (its
 *   label would be ambiguous);
 * - the split is by word: test when (FNV-1a 64 of the word >> 32) % 10 == 0
 *   (10%), else train; each split sorted by that hash (then language).
 * The features: the word wrapped as "<word>", its n-grams of n = 2..5
 * characters (UTF-8 code points; every position, duplicates kept), each
 * hashed with fastText's 32-bit FNV-1a (h = 2166136261; per byte: h ^=
 * (uint32)(int8)byte, h *= 16777619), id = hash % rows. */
#ifndef RESTPS_LANGID_H
#define RESTPS_LANGID_H

#include <stddef.h>
#include <stdint.h>

#define LANGID_DICT_DIR "/usr/share/dict"
#define LANGID_MAX_LANGS 16
#define LANGID_N_LANGS 11 /* the lists langid.c reads */
#define LANGID_MIN_N 2
#define LANGID_MAX_N 5
#define LANGID_WORD_MAX 32
#define LANGID_PER_LANG 20000
#define LANGID_ROWS_DEFAULT ((int64_t)1 << 21)

/* Examples of one split: example i's ids are ids[off[i] .. off[i+1]). */
typedef struct langid_split {
    int64_t n;
    const int64_t *off;     /* n + 1 */
    const int64_t *ids;     /* off[n] */
    const uint8_t *labels;  /* n */
    const char *const *words; /* n, for messages and the reference */
} langid_split;

typedef struct langid_dataset {
    int n_langs;
    const char *lang[LANGID_MAX_LANGS];  /* "english", ... (static) */
    const char *file[LANGID_MAX_LANGS];  /* "american-english", ... (static) */
    int64_t rows;
    langid_split train, test;
    void *mem; /* owned (langid_free) */
} langid_dataset;

/* The model of --data=langid: embed:ROWSxDIM[,mean|sum] then the dense
 * layers of rest (a layer list ending in dense:<languages>). */
#define LANGID_DEFAULT_SPEC "embed:2097152x16,mean,dense:11"
typedef struct langid_model {
    char spec[512]; /* the whole spec, as given */
    int64_t rows;
    int dim;
    int mean;       /* 1 mean (default), 0 sum */
    char rest[512]; /* the dense layers' spec */
} langid_model;

/* Load the word lists from dir (NULL: LANGID_DICT_DIR), ids hashed into rows
 * buckets. 0, or -1 with err (a missing list names its Debian package). */
int langid_load(const char *dir, int64_t rows, int64_t per_lang, langid_dataset *ds, char *err,
                size_t errlen);
void langid_free(langid_dataset *ds);

/* The ids of word (len bytes) into out (room for LANGID_MAX_IDS): how many. */
#define LANGID_MAX_IDS (4 * (LANGID_WORD_MAX + 2))
int langid_word_ids(const char *word, size_t len, int64_t rows, int64_t *out);

#endif
