/* store_fixture.c - the store fixture of the server modules' unit tests
 * (store_fixture.h): a store on a buffer pool of its own. */
#include <stdlib.h>

#include "store_fixture.h"

int store_fixture_init(store_fixture *fx, float lr, size_t pool_bytes)
{
    fx->pool = bufpool_new(pool_bytes);
    if (!fx->pool || store_init(&fx->s, lr, fx->pool) != STORE_OK) {
        bufpool_free(fx->pool);
        fx->pool = NULL;
        return -1;
    }
    return 0;
}

void store_fixture_destroy(store_fixture *fx)
{
    store_destroy(&fx->s);
    bufpool_free(fx->pool);
}

int store_fixture_setup(void **state, float lr)
{
    store_fixture *fx = calloc(1, sizeof(*fx));
    if (!fx)
        return -1;
    if (store_fixture_init(fx, lr, (size_t)16 << 20) != 0) {
        free(fx);
        return -1;
    }
    *state = fx;
    return 0;
}

int store_fixture_teardown(void **state)
{
    store_fixture *fx = *state;
    store_fixture_destroy(fx);
    free(fx);
    return 0;
}
