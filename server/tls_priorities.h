/* tls_priorities.h - checking a GnuTLS priority string (psd's --tls_priorities)
 * when the flags are read, so a bad one is a usage error (exit 2) that points
 * at the part GnuTLS rejects, not a failed server start. */
#ifndef RESTPS_TLS_PRIORITIES_H
#define RESTPS_TLS_PRIORITIES_H

#include <stddef.h>

/* 0 when this GnuTLS accepts prio; -1 with err ("GnuTLS rejects it at
 * '+NO-SUCH-THING': The request is invalid.") otherwise. */
int tls_priorities_check(const char *prio, char *err, size_t errlen);

#endif
