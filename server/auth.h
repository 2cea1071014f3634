/* auth.h - bearer tokens: load from a file, compare in constant time. */
#ifndef RESTPS_AUTH_H
#define RESTPS_AUTH_H

#include <stddef.h>

/* Read the token from path (surrounding whitespace stripped). malloc'd, or
 * NULL with err (missing, unreadable, empty). */
char *auth_token_load(const char *path, char *err, size_t errlen);

/* 1 when header is exactly "Bearer <token>", compared in constant time. */
int auth_check(const char *token, const char *authorization_header);

#endif
