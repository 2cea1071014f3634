/* log.c - timestamped lines on stderr; one write per line so threads don't interleave. */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

static void vlog(const char *level, const char *fmt, va_list ap)
{
    char line[1024];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = (int)strftime(line, sizeof(line), "%Y-%m-%dT%H:%M:%S", &tm);
    n += snprintf(line + n, sizeof(line) - (size_t)n, ".%03ldZ %s ", ts.tv_nsec / 1000000, level);
    if (n < (int)sizeof(line) - 1) {
        int m = vsnprintf(line + n, sizeof(line) - (size_t)n - 1, fmt, ap);
        n = m < 0 ? n : n + m;
    }
    if (n > (int)sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    ssize_t w = write(2, line, (size_t)n);
    (void)w;
}

void log_info(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog("info", fmt, ap);
    va_end(ap);
}

void log_error(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vlog("error", fmt, ap);
    va_end(ap);
}
