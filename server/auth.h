/* auth.h - bearer tokens: compare in constant time (token.h loads them). */
#ifndef RESTPS_AUTH_H
#define RESTPS_AUTH_H

#include <stddef.h>

/* 1 when header is "Bearer <token>" (token.h: the scheme in any case,
 * spaces after the token ignored), compared in constant time. */
int auth_check(const char *token, const char *authorization_header);

#endif
