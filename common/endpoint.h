/* endpoint.h - what every libmicrohttpd endpoint here answers with, written
 * once for psd (server/http.c) and a ring worker's endpoint (client/ring.c):
 * JSON bodies with a trailing newline, {"error": "..."} replies whose
 * message is kept printable ASCII, the WWW-Authenticate header of a 401, and
 * which host names mean this machine only. Nothing here exits: a response
 * that cannot be built is MHD_NO, and libmicrohttpd closes the connection. */
#ifndef RESTPS_ENDPOINT_H
#define RESTPS_ENDPOINT_H

#include <jansson.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stddef.h>

/* The longest error message sent, with its NUL. */
#define ENDPOINT_ERROR_MAX 512

/* Queue resp as status on c (a 401 also says WWW-Authenticate: Bearer) and
 * drop this reference to it. MHD_NO, queueing nothing, when resp is NULL. */
enum MHD_Result endpoint_queue(struct MHD_Connection *c, unsigned status, struct MHD_Response *resp);

/* A response that owns body_malloced (freed here when none can be built:
 * NULL), with Content-Type and Cache-Control: no-store. */
struct MHD_Response *endpoint_text_response(char *body_malloced, size_t len,
                                            const char *content_type);

/* The compact text of j_new (released here) and a newline, malloc'd, its
 * length in *len; NULL when j_new is NULL or anything failed. */
char *endpoint_json_text(json_t *j_new, size_t *len);

/* The message of an error reply: fmt formatted into msg (cap bytes), every
 * byte outside printable ASCII made '?' (messages quote client input). */
void endpoint_error_message(char *msg, size_t cap, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));

/* Answer j_new (released here) as application/json; MHD_NO when it cannot. */
enum MHD_Result endpoint_reply_json(struct MHD_Connection *c, unsigned status, json_t *j_new);

/* Answer {"error": msg} with status. */
enum MHD_Result endpoint_reply_error(struct MHD_Connection *c, unsigned status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* 1 when host names this machine only: "localhost", 127.x, "::1". */
int endpoint_host_is_loopback(const char *host);


/* The checks of a request's framing that libmicrohttpd 0.9.75 leaves to its
 * application (it drops a folded line, reads a field value or the request
 * line up to a NUL, and takes Content-Length beside Transfer-Encoding): for
 * the first call of a request, before any handler runs. 0 when the request
 * may go on; else the status to refuse it with, its message in msg (cap
 * bytes), to be sent with endpoint_reply_close. RFC 9112 section 6.3, RFC
 * 9110 section 5.5. */
unsigned endpoint_check_framing(struct MHD_Connection *c, const char *method, const char *url,
                                const char *version,
                                char *msg, size_t cap);

/* MHD_OPTION_URI_LOG_CALLBACK (cls unused; returns NULL, so the access
 * handler's first call still sees a NULL request pointer): a request target
 * over ENDPOINT_URI_MAX bytes, or a query of ENDPOINT_QUERY_ARGS_MAX
 * arguments or more, is marked so that endpoint_check_framing refuses it
 * with 414, and its query is not parsed. libmicrohttpd 0.9.75 parses the
 * query into its per-connection memory before any other callback: a
 * 18 KB query of 2,000 arguments filled it, and its own 431 was then never
 * sent (the client waited for the idle timeout). */
#define ENDPOINT_URI_MAX 8192
#define ENDPOINT_QUERY_ARGS_MAX 256
void *endpoint_uri_guard(void *cls, const char *uri, struct MHD_Connection *c);

/* For an unescape callback (http_unescape): a URL piece that ended at
 * old_end (its NUL) was decoded shorter, the bytes it freed made NULs, which
 * endpoint_check_framing then knows for libmicrohttpd's. c NULL: nothing. */
void endpoint_note_unescaped(struct MHD_Connection *c, const char *old_end);

/* Answer {"error": msg} with status and Connection: close, so that nothing
 * the client sent after this request's head is read as another request. */
enum MHD_Result endpoint_reply_close(struct MHD_Connection *c, unsigned status, const char *msg);
#endif
