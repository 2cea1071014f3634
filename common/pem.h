/* pem.h - reading a PEM file (a certificate chain or a key) whole, for
 * libmicrohttpd's MHD_OPTION_HTTPS_MEM_CERT/KEY: psd's --tls_cert/--tls_key
 * and workerd's --ring_tls_cert/--ring_tls_key. */
#ifndef RESTPS_PEM_H
#define RESTPS_PEM_H

#include <stddef.h>

/* The file's bytes, NUL-ended (free() them); NULL with err ("PATH: why")
 * when it cannot be read, is over 1 MiB or has no "-----BEGIN " line. */
char *pem_read(const char *path, char *err, size_t errlen);

#endif
