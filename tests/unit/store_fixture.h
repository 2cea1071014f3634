/* store_fixture.h - the store on a buffer pool of its own, as the unit tests
 * of the server's modules set it up (test_store, test_sync, test_push_in_body,
 * test_saver): cmocka's setup and teardown of one, and its two steps alone
 * for a test that builds several or holds one in a fixture of its own.
 * Linked with the server's objects (store.o, bufpool.o). */
#ifndef RESTPS_TEST_STORE_FIXTURE_H
#define RESTPS_TEST_STORE_FIXTURE_H

#include <stddef.h>

#include "bufpool.h"
#include "store.h"

typedef struct store_fixture {
    bufpool *pool;
    store s;
} store_fixture;

/* fx's pool of pool_bytes and its store at learning rate lr: 0, or -1 with
 * the pool freed again. */
int store_fixture_init(store_fixture *fx, float lr, size_t pool_bytes);
/* The store and the pool of a fixture store_fixture_init made. */
void store_fixture_destroy(store_fixture *fx);
/* cmocka setup: a fixture of its own (a 16 MiB pool, learning rate lr) in
 * *state; 0, or -1 with nothing left allocated. */
int store_fixture_setup(void **state, float lr);
/* cmocka teardown of store_fixture_setup's fixture. */
int store_fixture_teardown(void **state);

#endif
