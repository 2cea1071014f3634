/* auth.c - bearer-token checks for write (and optionally read) routes. */
#include "auth.h"

#include <string.h>

int auth_check(const char *token, const char *hdr)
{
    static const char scheme[] = "Bearer ";
    if (!hdr || strncmp(hdr, scheme, sizeof(scheme) - 1) != 0)
        return 0;
    const unsigned char *a = (const unsigned char *)hdr + sizeof(scheme) - 1;
    const unsigned char *b = (const unsigned char *)token;
    size_t la = strlen((const char *)a), lb = strlen(token);
    /* Time depends on the given length only, never on where bytes differ. */
    unsigned char diff = (unsigned char)(la != lb);
    for (size_t i = 0; i < la; i++)
        diff |= a[i] ^ b[i % lb];
    return diff == 0;
}
