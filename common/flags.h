/* flags.h - TensorFlow-style command-line flags (--name=value or --name value),
 * from one table that also prints --help, so the help always lists every flag. */
#ifndef RESTPS_FLAGS_H
#define RESTPS_FLAGS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum { FLAG_STRING, FLAG_INT, FLAG_U64, FLAG_FLOAT, FLAG_BOOL } flag_type;

typedef struct flag {
    const char *name; /* without "--" */
    flag_type type;
    void *value;      /* const char **, int *, uint64_t *, float *, int * */
    const char *help; /* says the default */
    int given;        /* set by flags_parse */
} flag;

/* Parse argv into the table. 0; 1 when --help was given; -1 with err (an
 * unknown flag, a missing or malformed value, a stray argument). */
int flags_parse(flag *flags, int n, int argc, char **argv, char *err, size_t errlen);
/* The same, for the program called prog: every error ends with one hint,
 * " (see PROG --help)"; an unknown flag's names the nearest known flag when
 * one is close: "unknown flag '--trian_steps' (did you mean --train_steps? see
 * PROG --help)" (flags_parse: the same hint without PROG, on an unknown flag). */
int flags_parse_prog(const char *prog, flag *flags, int n, int argc, char **argv, char *err,
                     size_t errlen);
/* The known flag nearest to name (its first len bytes, without "--"), or NULL
 * when none is close: an optimal-string-alignment (Damerau-Levenshtein)
 * distance, case ignored, of at most 2 and at most a third of len (at least
 * 1); the first of the table on a tie. */
const flag *flags_nearest(const flag *flags, int n, const char *name, size_t len);
void flags_help(FILE *out, const char *usage, const flag *flags, int n);
/* The entry called name, or NULL. */
const flag *flags_get(const flag *flags, int n, const char *name);

#endif
