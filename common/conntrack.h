/* conntrack.h - the open connections, and a deadline for each request's
 * headers. libmicrohttpd's --connection_timeout is an idle timeout: a client
 * that sends a header line every few seconds (slowloris) keeps its
 * connection for ever, and enough of them hold every --max_connections slot.
 * The tracker notes when each connection began to wait for a request's
 * headers (when it was accepted, and after each answered request), and its
 * thread shuts down the socket of a connection still waiting after
 * --connection_timeout seconds; libmicrohttpd then closes it as it closes
 * any connection the client ended. A request being served (its body being
 * read, a long poll, an event stream) is never cut here; a body that
 * trickles in is cut by routes.c. */
#ifndef RESTPS_CONNTRACK_H
#define RESTPS_CONNTRACK_H

#include <microhttpd.h>
#include <stdint.h>

struct conntrack;

/* Starts the thread (it looks every 250 ms). NULL when it cannot.
 * max_conns: libmicrohttpd's connection limit. A little below it (1/16 of
 * it, 1 to 64 fewer) the tracker makes room: each connection accepted past
 * that shuts down the one that has waited longest for a request's headers
 * (idle, or with its head half sent), so idle or half-sent connections
 * cannot lock others out; a request being served is never cut. The log
 * says how many were closed, and the first one's address, each line
 * beginning "WHO: " (the program's name, as http_server.c words it: "psd",
 * "workerd: ring endpoint"; NULL: "http"). */
struct conntrack *conntrack_start(const char *who, int timeout_secs, int max_conns);
/* After MHD_stop_daemon (every connection closed). */
void conntrack_stop(struct conntrack *t);

/* MHD_OPTION_NOTIFY_CONNECTION's callback; cls is the tracker. */
void conntrack_notify(void *cls, struct MHD_Connection *conn, void **socket_context,
                      enum MHD_ConnectionNotificationCode toe);

/* A request's headers are in (the access handler's first call) / it was
 * answered (the completion callback). */
void conntrack_request_begins(struct MHD_Connection *conn);
void conntrack_request_ends(struct MHD_Connection *conn);

#endif
