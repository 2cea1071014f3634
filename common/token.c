/* token.c - see token.h. */
#include "token.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

char *token_load(const char *path, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "unable to open token file '%s': %s", path, strerror(errno));
        return NULL;
    }
    char buf[4096];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    int too_long = !feof(f);
    fclose(f);
    if (too_long) {
        snprintf(err, errlen, "token file '%s' is over %zu bytes", path, sizeof(buf) - 1);
        return NULL;
    }
    buf[n] = '\0';
    char *s = buf;
    while (*s && isspace((unsigned char)*s))
        s++;
    size_t l = strlen(s);
    while (l && isspace((unsigned char)s[l - 1]))
        s[--l] = '\0';
    if (l == 0) {
        snprintf(err, errlen, "token file '%s' is empty", path);
        return NULL;
    }
    for (size_t i = 0; i < l; i++)
        if (!isgraph((unsigned char)s[i])) {
            snprintf(err, errlen, "token file '%s' holds a space or control character", path);
            return NULL;
        }
    return strdup(s);
}

int token_header_ok(const char *token, const char *hdr)
{
    /* RFC 9110 section 11.1: the scheme is case-insensitive ("bearer" is
     * "Bearer"). One space follows it, as every client sends (a second one
     * is refused, as before); spaces and tabs after the token are
     * whitespace around the field value (section 5.5), not part of the
     * token, so they are ignored. Anything else differs. */
    static const char scheme[] = "Bearer ";
    if (!hdr || strncasecmp(hdr, scheme, sizeof(scheme) - 1) != 0)
        return 0;
    const char *p = hdr + sizeof(scheme) - 1;
    const unsigned char *a = (const unsigned char *)p;
    const unsigned char *b = (const unsigned char *)token;
    size_t la = strlen(p), lb = strlen(token);
    while (la && (a[la - 1] == ' ' || a[la - 1] == '\t'))
        la--;
    if (lb == 0) /* token_load refuses empty tokens; never match one */
        return 0;
    /* Time depends on the given length only, never on where bytes differ. */
    unsigned char diff = (unsigned char)(la != lb);
    for (size_t i = 0; i < la; i++)
        diff |= a[i] ^ b[i % lb];
    return diff == 0;
}
