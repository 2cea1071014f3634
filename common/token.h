/* token.h - the bearer token shared by psd (which checks it) and workerd
 * (which sends it, and checks it on its ring endpoint), read from a file
 * (--auth_token_file). */
#ifndef RESTPS_TOKEN_H
#define RESTPS_TOKEN_H

#include <stddef.h>

/* Read the token from path (surrounding whitespace stripped). malloc'd, or
 * NULL with err (missing, unreadable, empty, or a space inside). */
char *token_load(const char *path, char *err, size_t errlen);

/* 1 when an Authorization header is "Bearer <token>", compared in constant
 * time (psd's routes and the ring endpoint of workerd both ask). The scheme
 * is case-insensitive, one space follows it, and spaces or tabs after the
 * token are ignored (RFC 9110 sections 11.1 and 5.5). */
int token_header_ok(const char *token, const char *authorization_header);

#endif
