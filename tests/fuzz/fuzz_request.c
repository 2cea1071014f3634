/* fuzz_request.c - what psd reads from a request before any handler runs, and
 * the header and query helpers the handlers call: the URL's %XX decoding
 * (http_unescape), the route pattern and {name} (the endpoint layer's
 * pattern_of over psd's table, routes.c), variable names
 * (tensor_name_check), X-Shape (tensor_shape_parse), If-None-Match
 * (etag_matches), the bearer token (token_header_ok), ?format= and Accept
 * (wants_json), ?offset=/?count= (query_count), and the JSON rendering of
 * float values as it is sent (json_stream_read, in blocks of every size).
 *
 * common/http_server.c and route_vars.c are included (and left out of the link) to
 * reach their static helpers without widening their interfaces. libmicrohttpd's header
 * lookup is replaced below by one that answers from the fuzz input.
 *
 * Input: newline-separated fields: URL, X-Shape, If-None-Match,
 * Authorization, ?format=, Accept, ?count=; the rest is float32 values. */
#include "../../common/http_server.c"
#include "../../server/routes.h"
#include "../../server/route_vars.c"

#include "fuzz_util.h"

static const char *fake_format, *fake_accept, *fake_count, *fake_inm;

/* Overrides libmicrohttpd's (the executable's definition wins). */
const char *MHD_lookup_connection_value(struct MHD_Connection *connection,
                                        enum MHD_ValueKind kind, const char *key)
{
    (void)connection;
    if (kind == MHD_GET_ARGUMENT_KIND) {
        const char *v = strcmp(key, "format") == 0 ? fake_format
                        : strcmp(key, "count") == 0 ? fake_count : NULL;
        return v && *v ? v : NULL;
    }
    if (kind == MHD_HEADER_KIND) {
        const char *v = strcasecmp(key, MHD_HTTP_HEADER_ACCEPT) == 0 ? fake_accept
                        : strcasecmp(key, MHD_HTTP_HEADER_IF_NONE_MATCH) == 0 ? fake_inm : NULL;
        return v && *v ? v : NULL;
    }
    return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *f[7];
    for (int i = 0; i < 7; i++)
        f[i] = fuzz_field(&data, &size, '\n');
    char err[512];

    /* URL: decoding never grows the string nor puts a NUL inside it. */
    size_t before = strlen(f[0]);
    size_t after = http_unescape(NULL, NULL, f[0]);
    FUZZ_CHECK(after <= before && after == strlen(f[0]));
    /* psd's table on a server that never starts */
    static http_server *hs;
    static server fake_srv;
    if (!hs) {
        http_server_config hc = {.name = "fuzz", .listen_fd = -1};
        http_module m;
        routes_module(&fake_srv, &m);
        hs = http_server_new(&hc, err, sizeof(err));
        FUZZ_CHECK(hs && http_server_add(hs, &m, err, sizeof(err)) == 0);
    }
    http_req hr;
    memset(&hr, 0, sizeof(hr));
    const char *pattern = pattern_of(hs, &hr, f[0]);
    const char *name = hr.name;
    FUZZ_CHECK(strlen(name) <= HTTP_NAME_MAX);
    /* every path under /v1/vars/ is a variable's (a bad name is a 400, not a 404) */
    FUZZ_CHECK(pattern || strncmp(f[0], "/v1/vars/", 9) != 0);
    FUZZ_CHECK(!pattern || !strstr(pattern, "{name}") || hr.name_ok == (name[0] != '\0' && after - strlen(pattern) + 6 <= HTTP_NAME_MAX));
    if (pattern && strstr(pattern, "{name}") && hr.name_ok && strlen(name) <= TENSOR_NAME_MAX &&
        tensor_name_check(name, err, sizeof(err)) == 0) {
        /* a valid name is a whole path segment list: no "..", no empty segment */
        FUZZ_CHECK(name[0] && !strstr(name, "..") && !strstr(name, "//") && name[0] != '/');
    }

    /* X-Shape: what parses prints back to itself. */
    tensor_shape s, s2;
    if (tensor_shape_parse(f[1], &s, err, sizeof(err)) == 0) {
        int64_t numel = tensor_shape_numel(&s);
        FUZZ_CHECK(numel >= 1 && numel <= TENSOR_MAX_ELEMS && s.ndim <= TENSOR_MAX_DIMS);
        char buf[256];
        tensor_shape_header(&s, buf, sizeof(buf));
        FUZZ_CHECK(tensor_shape_parse(buf, &s2, err, sizeof(err)) == 0 && tensor_shape_equal(&s, &s2));
    }

    /* If-None-Match against this shape's ETag form, and against itself. */
    fake_inm = f[2];
    (void)etag_matches(f[2], "\"3-7\"");
    if (f[2][0] && !strchr(f[2], ',') && f[2][0] != ' ' && f[2][strlen(f[2]) - 1] != ' ' &&
        strncmp(f[2], "W/", 2) != 0)
        FUZZ_CHECK(etag_matches(f[2], f[2]));

    /* Authorization: only "Bearer" in any case, one space, the exact token,
     * then nothing but spaces and tabs passes (RFC 9110 11.1 and 5.5). */
    int ok = token_header_ok("s3cret-token", f[3]);
    size_t al = strlen(f[3]);
    int want = al >= 19 && strncasecmp(f[3], "bearer ", 7) == 0 && memcmp(f[3] + 7, "s3cret-token", 12) == 0;
    for (size_t i = 19; want && i < al; i++)
        want = f[3][i] == ' ' || f[3][i] == '\t';
    FUZZ_CHECK(ok == want);

    /* ?format=, Accept, ?count= through the lookup above. */
    request r;
    memset(&r, 0, sizeof(r));
    fake_format = f[4];
    fake_accept = f[5];
    fake_count = f[6];
    int bad;
    int j = wants_json(&r, &bad);
    FUZZ_CHECK(!(j && bad));
    int64_t c = query_count(&r, "count");
    FUZZ_CHECK(c >= -2);

    /* The rest: float values rendered as JSON must parse back, NaN/Inf as null. */
    size_t n = size / sizeof(float);
    if (n > 4096)
        n = 4096;
    float *x = malloc(n ? n * sizeof(float) : 1);
    FUZZ_CHECK(x);
    if (n)
        memcpy(x, data, n * sizeof(float));
    /* json_stream_read as libmicrohttpd calls it, in blocks of 1 to 64
     * bytes (from the input), so that every value and the head and tail
     * cross block edges; the text must be {"v":[...]} parsing back. */
    json_stream st = {.x = x, .n = (int64_t)n};
    st.head = strdup("{\"v\":[");
    FUZZ_CHECK(st.head);
    st.head_len = strlen(st.head);
    /* a value is at most 16 bytes with its comma; a block of room beyond */
    size_t cap = 16 + 64 + n * 20, len = 0, step = 1 + (size ? data[0] % 64 : 0);
    char *js = malloc(cap + 1);
    FUZZ_CHECK(js);
    for (;;) {
        FUZZ_CHECK(len + step <= cap);
        ssize_t got = json_stream_read(&st, len, js + len, step);
        if (got == MHD_CONTENT_READER_END_OF_STREAM)
            break;
        FUZZ_CHECK(got > 0 && (size_t)got <= step);
        len += (size_t)got;
    }
    free(st.head);
    js[len] = '\0';
    json_error_t jerr;
    json_t *doc = json_loadb(js, len, 0, &jerr);
    json_t *arr = doc ? json_object_get(doc, "v") : NULL;
    FUZZ_CHECK(arr && json_is_array(arr) && json_array_size(arr) == n);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(arr, i);
        if (isfinite(x[i]))
            FUZZ_CHECK(json_is_number(v) && (float)json_number_value(v) == x[i]);
        else
            FUZZ_CHECK(json_is_null(v));
    }
    json_decref(doc);
    free(js);
    free(x);
    fake_format = fake_accept = fake_count = fake_inm = NULL;
    for (int i = 0; i < 7; i++)
        free(f[i]);
    return 0;
}
