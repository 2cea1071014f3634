/* crc32c.h - CRC-32C (Castagnoli, the iSCSI/ext4 polynomial 0x1EDC6F41,
 * reflected), the checksum of every tensor in a checkpoint. Uses the CPU's
 * crc32 instruction where it has one (SSE4.2), a table otherwise; both give
 * the same value. crc32c("123456789") = 0xE3069283. */
#ifndef RESTPS_CRC32C_H
#define RESTPS_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Continue a checksum: crc32c_update(0, ...) starts one; feeding the bytes in
 * pieces gives the same value as feeding them at once. */
uint32_t crc32c_update(uint32_t crc, const void *buf, size_t len);

static inline uint32_t crc32c(const void *buf, size_t len)
{
    return crc32c_update(0, buf, len);
}

#endif
