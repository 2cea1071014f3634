/* test_tfevents.c - common/tfevents.c: the masked CRC-32C against published
 * vectors (RFC 3720's CRC-32C values; the masked ones as TensorBoard's own
 * Python reader computes them), the TFRecord framing, the Event encoding
 * against the bytes Python's protobuf writes for the same messages, and the
 * writer: file name, record order, the sample callback, a folder it cannot
 * create. (tests/system/test_tensorboard.py reads psd's files with
 * TensorBoard itself.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crc32c.h"
#include "tfevents.h"

static void crc32c_matches_rfc3720_vectors(void **state)
{
    (void)state;
    unsigned char zeros[32] = {0}, ones[32], inc[32];
    memset(ones, 0xff, sizeof(ones));
    for (int i = 0; i < 32; i++)
        inc[i] = (unsigned char)i;
    assert_int_equal(crc32c("123456789", 9), 0xE3069283u);
    assert_int_equal(crc32c(zeros, 32), 0x8A9136AAu);
    assert_int_equal(crc32c(ones, 32), 0x62A8AB43u);
    assert_int_equal(crc32c(inc, 32), 0x46DD794Eu);
}

static void masked_crc_is_tfrecords_rotation_plus_delta(void **state)
{
    (void)state;
    /* ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8 */
    assert_int_equal(tfevents_masked_crc("123456789", 9), 0xC78AB0E5u);
    assert_int_equal(tfevents_masked_crc("", 0), 0xA282EAD8u); /* crc 0 */
    unsigned char len0[8] = {0};
    assert_int_equal(tfevents_masked_crc(len0, 8), 0x07980329u);
}

static uint32_t le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void frame_of_empty_data_is_the_known_16_bytes(void **state)
{
    (void)state;
    unsigned char out[16];
    static const unsigned char want[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0x29, 0x03, 0x98, 0x07,
                                           0xd8, 0xea, 0x82, 0xa2};
    assert_int_equal(tfevents_frame(out, "", 0), 16);
    assert_memory_equal(out, want, 16);
}

static void frame_holds_length_crcs_and_data(void **state)
{
    (void)state;
    unsigned char out[9 + 16];
    assert_int_equal(tfevents_frame(out, "123456789", 9), 25);
    static const unsigned char len[8] = {9, 0, 0, 0, 0, 0, 0, 0};
    assert_memory_equal(out, len, 8);
    assert_int_equal(le32(out + 8), tfevents_masked_crc(len, 8));
    assert_memory_equal(out + 12, "123456789", 9);
    assert_int_equal(le32(out + 21), 0xC78AB0E5u);
}

static void unhex(const char *h, unsigned char *out, size_t *n)
{
    *n = 0;
    for (; h[0] && h[1]; h += 2) {
        unsigned v;
        sscanf(h, "%2x", &v);
        out[(*n)++] = (unsigned char)v;
    }
}

/* event_pb2.Event(wall_time=1.5, step=300, summary=...{tag="loss",
 * simple_value=0.25}).SerializeToString(), from tensorboard 2.21's protos */
static void scalar_event_is_what_protobuf_writes(void **state)
{
    (void)state;
    unsigned char want[64], got[256];
    size_t n;
    unhex("09000000000000f83f10ac022a0d0a0b0a046c6f7373150000803e", want, &n);
    int k = tfevents_encode_scalar(got, sizeof(got), 1.5, 300, "loss", 0.25f);
    assert_int_equal(k, (int)n);
    assert_memory_equal(got, want, n);
    /* step 0: protobuf leaves the field out, we write it: 10 00 in the middle */
    unhex("09000000000000f83f10002a0d0a0b0a046c6f7373150000803e", want, &n);
    k = tfevents_encode_scalar(got, sizeof(got), 1.5, 0, "loss", 0.25f);
    assert_int_equal(k, (int)n);
    assert_memory_equal(got, want, n);
}

/* event_pb2.Event(wall_time=1.5, file_version="brain.Event:2") */
static void version_event_is_what_protobuf_writes(void **state)
{
    (void)state;
    unsigned char want[64], got[64];
    size_t n;
    unhex("09000000000000f83f1a0d627261696e2e4576656e743a32", want, &n);
    int k = tfevents_encode_version(got, sizeof(got), 1.5);
    assert_int_equal(k, (int)n);
    assert_memory_equal(got, want, n);
    assert_int_equal(tfevents_encode_version(got, 10, 1.5), -ENOSPC);
}

static void long_tags_use_two_byte_lengths(void **state)
{
    (void)state;
    char tag[TFEVENTS_TAG_MAX + 2];
    memset(tag, 'a', sizeof(tag));
    tag[TFEVENTS_TAG_MAX] = '\0';
    unsigned char got[512];
    int k = tfevents_encode_scalar(got, sizeof(got), 2.0, 1, tag, 1.0f);
    /* head 9 + 2, summary key + 2-byte length, value key + 2-byte length,
     * tag key + 1-byte length (128 > 127: two bytes), tag, float 5 */
    assert_int_equal(k, 11 + 3 + 3 + 3 + TFEVENTS_TAG_MAX + 5);
    assert_int_equal(got[11], 0x2a);
    assert_true(got[12] & 0x80); /* 139: a varint with its continuation bit */
    assert_int_equal(got[13], 1);
    tag[TFEVENTS_TAG_MAX] = 'a';
    tag[TFEVENTS_TAG_MAX + 1] = '\0';
    assert_int_equal(tfevents_encode_scalar(got, sizeof(got), 2.0, 1, tag, 1.0f), -EINVAL);
    assert_int_equal(tfevents_encode_scalar(got, sizeof(got), 2.0, 1, "", 1.0f), -EINVAL);
    assert_int_equal(tfevents_encode_scalar(got, 20, 2.0, 1, "loss", 1.0f), -ENOSPC);
}

/* ---- the writer ---- */

static unsigned char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    unsigned char *b = malloc(1 << 20);
    *n = fread(b, 1, 1 << 20, f);
    fclose(f);
    return b;
}

static void count_samples(void *ctx, tfevents *w)
{
    int *samples = ctx;
    if ((*samples)++ == 0) /* the first one adds a scalar */
        tfevents_scalar(w, "sampled", 7, 3.0, 7.0);
}

static void writer_writes_version_then_records_in_order(void **state)
{
    (void)state;
    char tmpl[] = "/tmp/test_tfevents.XXXXXX", dir[256], path[4200];
    assert_non_null(mkdtemp(tmpl));
    snprintf(dir, sizeof(dir), "%s/a/b", tmpl); /* made with its parents */
    tfevents *w;
    int samples = 0;
    assert_int_equal(tfevents_open(&w, "test", dir, 60000, count_samples, &samples), 0);
    tfevents_path(w, path, sizeof(path));
    assert_string_equal(path, ""); /* nothing written: no file yet */
    for (int i = 1; i <= 3; i++)
        tfevents_scalar(w, "loss", i, 10.0 + i, 1.0 / i);
    tfevents_scalar(w, "", 4, 14.0, 0.0); /* refused: not queued */
    assert_int_equal(tfevents_flush(w), 0);
    tfevents_path(w, path, sizeof(path));
    char host[256] = "";
    gethostname(host, sizeof(host) - 1);
    char want_pid[32];
    snprintf(want_pid, sizeof(want_pid), ".%ld", (long)getpid());
    const char *base = strrchr(path, '/') + 1;
    assert_int_equal(strncmp(base, "events.out.tfevents.", 20), 0);
    assert_non_null(strstr(base, host));
    assert_string_equal(base + strlen(base) - strlen(want_pid), want_pid);
    tfevents_scalar(w, "loss", 5, 15.0, 5.0);
    tfevents_close(w); /* samples once, writes the rest */
    assert_int_equal(samples, 1);

    size_t n;
    unsigned char *b = slurp(path, &n);
    size_t off = 0;
    int rec = 0;
    int64_t steps[8];
    while (off + 16 <= n) {
        uint64_t len = 0;
        for (int i = 0; i < 8; i++)
            len |= (uint64_t)b[off + i] << (8 * i);
        assert_int_equal(le32(b + off + 8), tfevents_masked_crc(b + off, 8));
        assert_true(off + 16 + len <= n);
        assert_int_equal(le32(b + off + 12 + len), tfevents_masked_crc(b + off + 12, len));
        unsigned char want[256];
        int k;
        if (rec == 0) { /* file_version, its wall time is now: check the rest */
            assert_int_equal(b[off + 12 + 9], 0x1a);
            assert_memory_equal(b + off + 12 + 11, TFEVENTS_FILE_VERSION, 13);
        } else {
            static const int64_t order[] = {0, 1, 2, 3, 5, 7};
            static const double vals[] = {0, 1.0, 0.5, 1.0 / 3, 5.0, 7.0};
            steps[rec] = order[rec];
            k = tfevents_encode_scalar(want, sizeof(want), rec == 5 ? 3.0 : 10.0 + (double)order[rec],
                                       order[rec], rec == 5 ? "sampled" : "loss", (float)vals[rec]);
            assert_int_equal((int)len, k);
            assert_memory_equal(b + off + 12, want, len);
        }
        off += 16 + len;
        rec++;
    }
    assert_int_equal(off, n);
    assert_int_equal(rec, 6);
    assert_int_equal(steps[4], 5);
    free(b);
    unlink(path);
    snprintf(path, sizeof(path), "%s/a/b", tmpl);
    rmdir(path);
    snprintf(path, sizeof(path), "%s/a", tmpl);
    rmdir(path);
    rmdir(tmpl);
}

static void writer_under_a_file_fails_without_stopping(void **state)
{
    (void)state;
    char tmpl[] = "/tmp/test_tfevents.XXXXXX", dir[256];
    int fd = mkstemp(tmpl);
    assert_true(fd >= 0);
    close(fd);
    snprintf(dir, sizeof(dir), "%s/sub", tmpl); /* a folder inside a regular file */
    tfevents *w;
    assert_int_equal(tfevents_open(&w, "test", dir, 60000, NULL, NULL), 0);
    tfevents_scalar(w, "loss", 1, 1.0, 1.0);
    tfevents_scalar(w, "loss", 2, 2.0, 2.0);
    assert_int_equal(tfevents_flush(w), -ENOTDIR);
    assert_int_equal(tfevents_dropped(w), 2);
    tfevents_scalar(w, "loss", 3, 3.0, 3.0);
    assert_int_equal(tfevents_flush(w), -ENOTDIR); /* tried again, logged once */
    assert_int_equal(tfevents_dropped(w), 3);
    char path[4200];
    tfevents_path(w, path, sizeof(path));
    assert_string_equal(path, "");
    tfevents_close(w);
    unlink(tmpl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(crc32c_matches_rfc3720_vectors),
        cmocka_unit_test(masked_crc_is_tfrecords_rotation_plus_delta),
        cmocka_unit_test(frame_of_empty_data_is_the_known_16_bytes),
        cmocka_unit_test(frame_holds_length_crcs_and_data),
        cmocka_unit_test(scalar_event_is_what_protobuf_writes),
        cmocka_unit_test(version_event_is_what_protobuf_writes),
        cmocka_unit_test(long_tags_use_two_byte_lengths),
        cmocka_unit_test(writer_writes_version_then_records_in_order),
        cmocka_unit_test(writer_under_a_file_fails_without_stopping),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
