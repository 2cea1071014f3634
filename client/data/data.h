/* data.h - data/'s public header: the IDX files (idx.h: Fashion-MNIST as
 * Debian ships it, the splits) and the data order and batch buffers
 * (batcher.h). */
#ifndef RESTPS_DATA_H
#define RESTPS_DATA_H

#include "data/batcher.h"
#include "data/idx.h"
#include "data/langid.h"

#endif
