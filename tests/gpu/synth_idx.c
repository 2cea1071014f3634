/* synth_idx.c - a learnable MNIST-format data set for tests/gpu/check.sh on a
 * machine without Fashion-MNIST: 10 classes, each a random 28x28 template,
 * every image its class's template plus noise (the loss falls within a few
 * hundred steps). Writes the four raw IDX files into DIR.
 *   synth_idx DIR */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t st = 0x9e3779b97f4a7c15ULL;
static uint32_t next(void)
{
    st ^= st << 13;
    st ^= st >> 7;
    st ^= st << 17;
    return (uint32_t)(st >> 11);
}

static int put_be32(FILE *f, uint32_t v)
{
    unsigned char b[4] = {(unsigned char)(v >> 24), (unsigned char)(v >> 16), (unsigned char)(v >> 8),
                          (unsigned char)v};
    return fwrite(b, 1, 4, f) == 4 ? 0 : -1;
}

static int write_set(const char *dir, const char *img, const char *lab, int n,
                     const unsigned char tmpl[10][784])
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, img);
    FILE *fi = fopen(path, "wb");
    snprintf(path, sizeof(path), "%s/%s", dir, lab);
    FILE *fl = fopen(path, "wb");
    if (!fi || !fl) {
        perror(path);
        return -1;
    }
    int bad = put_be32(fi, 0x803) | put_be32(fi, (uint32_t)n) | put_be32(fi, 28) | put_be32(fi, 28) |
              put_be32(fl, 0x801) | put_be32(fl, (uint32_t)n);
    unsigned char px[784];
    for (int i = 0; i < n && !bad; i++) {
        unsigned char y = (unsigned char)(next() % 10);
        for (int k = 0; k < 784; k++) {
            int v = (int)tmpl[y][k] + (int)(next() % 161) - 80;
            px[k] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v);
        }
        bad |= fwrite(px, 1, 784, fi) != 784 || fwrite(&y, 1, 1, fl) != 1;
    }
    bad |= fclose(fi) != 0;
    bad |= fclose(fl) != 0;
    if (bad)
        fprintf(stderr, "synth_idx: writing %s failed\n", dir);
    return bad ? -1 : 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: synth_idx DIR\n");
        return 2;
    }
    static unsigned char tmpl[10][784];
    unsigned char base[784];
    for (int k = 0; k < 784; k++)
        base[k] = (unsigned char)(60 + next() % 100);
    for (int c = 0; c < 10; c++) /* a class differs from the base in ~10% of the pixels */
        for (int k = 0; k < 784; k++)
            tmpl[c][k] = (unsigned char)(base[k] + (next() % 10 == 0 ? 30 : 0));
    if (write_set(argv[1], "train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60000, tmpl) != 0 ||
        write_set(argv[1], "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10000, tmpl) != 0)
        return 1;
    return 0;
}
