/* langid_worker.c - --data=langid against the ps tasks: refused until written (issue 34 part 2). */
#include <stdio.h>

#include "workerd/langid_train.h"

int train_langid_worker(const train_config *c)
{
    fprintf(stderr, "%s: --data=langid: not yet with the ps\n", c->name);
    return 2;
}
