/* log.h - one-line messages on stderr, with the time. */
#ifndef RESTPS_LOG_H
#define RESTPS_LOG_H

void log_info(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void log_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
