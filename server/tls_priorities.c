/* tls_priorities.c - see tls_priorities.h. libmicrohttpd hands the string to
 * gnutls_priority_init; this asks GnuTLS the same question up front. */
#include "tls_priorities.h"

#include <stdio.h>
#include <gnutls/gnutls.h>

int tls_priorities_check(const char *prio, char *err, size_t errlen)
{
    gnutls_priority_t p;
    const char *at = NULL;
    int rc = gnutls_priority_init(&p, prio, &at);
    if (rc == GNUTLS_E_SUCCESS) {
        gnutls_priority_deinit(p);
        return 0;
    }
    if (at && *at)
        snprintf(err, errlen, "GnuTLS rejects it at '%s': %s", at, gnutls_strerror(rc));
    else
        snprintf(err, errlen, "GnuTLS rejects it: %s", gnutls_strerror(rc));
    return -1;
}
