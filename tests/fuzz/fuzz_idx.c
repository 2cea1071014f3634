/* fuzz_idx.c - the IDX reader (client/idx.c): magic, dimensions, data length,
 * gzip or plain. The bytes go into an in-memory file; both readers read it (the
 * magic lets at most one past its first check). What is accepted must hold the
 * counts the header declared, pixels in [0, 1] and labels below the class count. */
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "data/idx.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char path[64], err[512] = "";
    int fd = fuzz_memfile(data, size, path, sizeof(path));
    if (fd < 0)
        return 0;
    float *images = NULL;
    int64_t n = 0;
    int rows = 0, cols = 0;
    if (idx_read_images(path, &images, &n, &rows, &cols, err, sizeof(err)) == 0) {
        FUZZ_CHECK(n > 0 && rows > 0 && cols > 0 && images);
        int64_t total = n * rows * cols;
        for (int64_t i = 0; i < total; i++)
            FUZZ_CHECK(images[i] >= 0.0f && images[i] <= 1.0f);
        free(images);
    } else {
        FUZZ_CHECK(err[0] != '\0' && images == NULL);
    }
    uint8_t *labels = NULL;
    err[0] = '\0';
    if (idx_read_labels(path, IDX_N_CLASSES, &labels, &n, err, sizeof(err)) == 0) {
        FUZZ_CHECK(n > 0 && labels);
        for (int64_t i = 0; i < n; i++)
            FUZZ_CHECK(labels[i] < IDX_N_CLASSES);
        free(labels);
    } else {
        FUZZ_CHECK(err[0] != '\0' && labels == NULL);
    }
    close(fd);
    return 0;
}
