/* pipeline.h - pipeline/'s public header: model parallelism's parts, which
 * workerd's stage role (workerd/pipeline_train.c) puts together: the split of
 * the layers into stages (pipeline_plan.h), the gpipe and 1f1b tables
 * (pipeline_schedule.h), the receive buffer (pipeline_mailbox.h), the ring
 * between a stage's replicas (pipeline_ring.h), the stage's endpoint and its
 * sends (pipeline_link.h) and the stage's variables on the ps
 * (pipeline_ps.h). */
#ifndef RESTPS_PIPELINE_H
#define RESTPS_PIPELINE_H

#include "pipeline/pipeline_link.h"
#include "pipeline/pipeline_mailbox.h"
#include "pipeline/pipeline_plan.h"
#include "pipeline/pipeline_ps.h"
#include "pipeline/pipeline_ring.h"
#include "pipeline/pipeline_schedule.h"

#endif
