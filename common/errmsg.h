/* errmsg.h - fill a caller's one-line error buffer and return -1, the
 * convention of every "0 or -1 with err" function. */
#ifndef RESTPS_ERRMSG_H
#define RESTPS_ERRMSG_H

#include <stddef.h>

/* vsnprintf into err (when err and errlen are non-zero); returns -1. */
int errmsg(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif
