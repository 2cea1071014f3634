/* route_checkpoint.c - GET /v1/checkpoint (the newest checkpoint file,
 * streamed with sendfile) and POST /v1/checkpoint (save now). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "routes.h"
#include "saver.h"

enum MHD_Result h_checkpoint_get(request *r)
{
    saver *sv = req_srv(r)->saver;
    if (!sv)
        return http_reply_error(r, MHD_HTTP_NOT_FOUND, "checkpoints are off on this ps (--logdir is empty)");
    char path[PATH_MAX];
    int64_t step;
    int fd = -1;
    /* a save may remove the file between the look-up and the open: ask again */
    for (int tries = 0; fd < 0 && tries < 3; tries++) {
        if (saver_latest(sv, path, sizeof(path), &step) != 0)
            return http_reply_error(r, MHD_HTTP_NOT_FOUND,
                                    "no checkpoint yet (POST /v1/checkpoint saves one now)");
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "cannot read %s: %s", path,
                                strerror(e));
    }
    struct MHD_Response *resp = MHD_create_response_from_fd((uint64_t)st.st_size, fd);
    if (!resp) {
        close(fd);
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "cannot build the response");
    }
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    char disp[PATH_MAX + 64], step_s[32];
    snprintf(disp, sizeof(disp), "attachment; filename=\"%s\"", base);
    snprintf(step_s, sizeof(step_s), "%lld", (long long)step);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
    MHD_add_response_header(resp, "Content-Disposition", disp);
    MHD_add_response_header(resp, "X-Global-Step", step_s);
    MHD_add_response_header(resp, "X-Checkpoint", base);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    r->status = MHD_HTTP_OK;
    r->bytes_out = strcmp(r->method, "HEAD") == 0 ? 0 : (uint64_t)st.st_size;
    enum MHD_Result rc = MHD_queue_response(r->conn, MHD_HTTP_OK, resp);
    MHD_destroy_response(resp);
    r->answered = 1;
    return rc;
}

static void resume_conn(void *key)
{
    MHD_resume_connection(key);
}

enum MHD_Result h_checkpoint_post(request *r)
{
    saver *sv = req_srv(r)->saver;
    if (!sv)
        return http_reply_error(r, MHD_HTTP_CONFLICT, "checkpoints are off on this ps (--logdir is empty)");
    char path[PATH_MAX], err[512];
    int64_t step = -1;
    int rc = SAVER_ENOJOB;
    if (!req_psd(r)->parked) {
        /* a save takes seconds for a big model: the saver's thread writes it
         * while this connection is suspended, however long that takes, and
         * this handler runs again once it is resumed with the outcome (at a
         * stop, psd waits for that before it stops its HTTP server) */
        req_psd(r)->parked = 1;
        MHD_suspend_connection(r->conn);
        req_psd(r)->saver_job = 1; /* routes_completed forgets it if not collected */
        if (saver_save_async(sv, r->conn, resume_conn) != 0) {
            req_psd(r)->saver_job = 0;
            MHD_resume_connection(r->conn); /* not queued (out of memory): saved below */
        }
        return MHD_YES;
    }
    if (req_psd(r)->parked) {
        rc = saver_result(sv, r->conn, path, sizeof(path), &step, err, sizeof(err));
        if (rc != SAVER_ENOJOB)
            req_psd(r)->saver_job = 0; /* collected */
    }
    if (rc == SAVER_ENOJOB) /* not queued (out of memory): on this thread (a stop waits for it) */
        rc = saver_save_requested(sv, path, sizeof(path), &step, err, sizeof(err));
    if (rc == SAVER_STOPPING)
        return http_reply_error(r, MHD_HTTP_SERVICE_UNAVAILABLE, "%s", err);
    if (rc < 0)
        return http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR,
                                "checkpoint failed: %s (the previous checkpoint is intact)", err);
    const char *base = strrchr(path, '/');
    return http_reply_json(r, MHD_HTTP_OK,
                           json_pack("{s:s,s:s,s:I}", "file", base ? base + 1 : path, "path", path,
                                     "global_step", (json_int_t)step));
}
