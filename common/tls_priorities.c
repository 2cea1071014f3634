/* tls_priorities.c - see tls_priorities.h. libmicrohttpd hands the string to
 * gnutls_priority_init; this asks GnuTLS the same question up front. */
#include "tls_priorities.h"

#include <stdio.h>
#include <gnutls/gnutls.h>

/* The TLS (not DTLS) versions p enables, as in tls_priorities_versions. */
static int versions(gnutls_priority_t p, int *lo, int *hi)
{
    const unsigned int *list;
    int n = gnutls_priority_protocol_list(p, &list);
    *lo = 4;
    *hi = -1;
    for (int i = 0; i < n; i++) {
        int minor = list[i] == GNUTLS_TLS1_0 ? 0 : list[i] == GNUTLS_TLS1_1 ? 1
                  : list[i] == GNUTLS_TLS1_2 ? 2 : list[i] == GNUTLS_TLS1_3 ? 3 : -1;
        if (minor < 0)
            continue;
        if (minor < *lo)
            *lo = minor;
        if (minor > *hi)
            *hi = minor;
    }
    return *hi >= 0 ? 0 : -1;
}

int tls_priorities_check(const char *prio, char *err, size_t errlen)
{
    gnutls_priority_t p;
    const char *at = NULL;
    int rc = gnutls_priority_init(&p, prio, &at);
    if (rc == GNUTLS_E_SUCCESS) {
        int lo, hi, vr = versions(p, &lo, &hi);
        gnutls_priority_deinit(p);
        if (vr == 0)
            return 0;
        snprintf(err, errlen, "it enables no TLS version (DTLS at most)");
        return -1;
    }
    if (at && *at)
        snprintf(err, errlen, "GnuTLS rejects it at '%s': %s", at, gnutls_strerror(rc));
    else
        snprintf(err, errlen, "GnuTLS rejects it: %s", gnutls_strerror(rc));
    return -1;
}

int tls_priorities_versions(const char *prio, int *lo, int *hi)
{
    gnutls_priority_t p;
    if (gnutls_priority_init(&p, prio, NULL) != GNUTLS_E_SUCCESS)
        return -1;
    int rc = versions(p, lo, hi);
    gnutls_priority_deinit(p);
    return rc;
}
