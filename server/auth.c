/* auth.c - bearer-token checks for write (and optionally read) routes; the
 * comparison itself is common/token.c's, shared with workerd's ring. */
#include "auth.h"

#include "token.h"

int auth_check(const char *token, const char *hdr) { return token_header_ok(token, hdr); }
