/* reply_blobs.c - psd's answers built from blobs without a copy: the
 * response reads the stored tensors themselves and holds a reference to
 * each until libmicrohttpd frees it (request.h). */
#include "request.h"

#include <stdlib.h>

typedef struct parts_ctx {
    char *head;
    int n_hold;
    blob *hold[];
} parts_ctx;

static void parts_free(void *cls)
{
    parts_ctx *c = cls;
    for (int i = 0; i < c->n_hold; i++)
        blob_unref(c->hold[i]);
    free(c->head);
    free(c);
}

enum MHD_Result reply_blobs(request *r, unsigned status, const char *content_type, char *head,
                            size_t head_len, const struct http_part *parts, int n_parts, blob **hold,
                            int n_hold, const char *const *headers)
{
    parts_ctx *c = malloc(sizeof(*c) + sizeof(blob *) * (size_t)n_hold);
    struct MHD_IoVec *iov = malloc(sizeof(*iov) * (size_t)(n_parts + 1));
    if (!c || !iov) {
        free(c);
        free(iov);
        free(head);
        return http_reply_error(r, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory");
    }
    c->head = head;
    c->n_hold = n_hold;
    for (int i = 0; i < n_hold; i++)
        c->hold[i] = blob_ref(hold[i]);
    int k = 0;
    uint64_t bytes = head_len;
    for (int i = 0; i < n_parts; i++)
        bytes += parts[i].len;
    if (head && head_len) {
        iov[k].iov_base = head;
        iov[k++].iov_len = head_len;
    }
    for (int i = 0; i < n_parts; i++)
        if (parts[i].len) {
            iov[k].iov_base = parts[i].base;
            iov[k++].iov_len = parts[i].len;
        }
    struct MHD_Response *resp = MHD_create_response_from_iovec(iov, (unsigned)k, parts_free, c);
    free(iov);
    if (!resp) {
        parts_free(c);
        return http_reply_response(r, status, NULL, 0);
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    for (int i = 0; headers && headers[i]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
    return http_reply_response(r, status, resp, bytes);
}
