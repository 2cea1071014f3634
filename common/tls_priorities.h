/* tls_priorities.h - GnuTLS priority strings, the TLS versions and cipher
 * suites an HTTPS endpoint takes: the default psd (--tls_priorities) and the
 * ring (workerd --ring_tls_priorities) serve with, checking one when the
 * flags are read (so a bad one is a usage error, exit 2, that points at the
 * part GnuTLS rejects, not a failed start), and the TLS versions one enables
 * (the ring's pushes offer those alone). Links -lgnutls. */
#ifndef RESTPS_TLS_PRIORITIES_H
#define RESTPS_TLS_PRIORITIES_H

#include <stddef.h>

/* TLS 1.3 and 1.2 only; AEAD suites only (AES-GCM, then ChaCha20-Poly1305),
 * ECDHE key exchange; and the server's order wins. libmicrohttpd's own
 * default took TLS 1.0/1.1, CBC/SHA-1 and RSA key exchange, and followed the
 * client's order: a client listing ChaCha20 first got it, and GnuTLS 3.7's
 * ChaCha20-Poly1305 runs at 0.29 GB/s on this kind of CPU against 4.9 GB/s
 * for AES-128-GCM (gnutls-cli --benchmark-ciphers): one step's push + pull of
 * 16 MiB to psd went 2.7x slower. */
#define TLS_PRIORITIES_DEFAULT                                                              \
    "NORMAL:-VERS-ALL:+VERS-TLS1.3:+VERS-TLS1.2:-CIPHER-ALL:+AES-256-GCM:+AES-128-GCM:"     \
    "+CHACHA20-POLY1305:-MAC-ALL:+AEAD:-KX-ALL:+ECDHE-ECDSA:+ECDHE-RSA:%SERVER_PRECEDENCE"

/* 0 when this GnuTLS accepts prio and it enables a TLS version; -1 with err
 * ("GnuTLS rejects it at '+NO-SUCH-THING': The request is invalid.", or "it
 * enables no TLS version (DTLS only)") otherwise. */
int tls_priorities_check(const char *prio, char *err, size_t errlen);

/* The lowest and highest TLS version prio enables, as minor numbers (TLS 1.x:
 * x, 0 to 3): 0; -1 when GnuTLS rejects it or it enables none. */
int tls_priorities_versions(const char *prio, int *lo, int *hi);

#endif
