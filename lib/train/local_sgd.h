/*
 * comm/local_sgd.h - local SGD (local_sgd.c): ranks of a data-parallel run
 * step apart on their own rows and average their weights every H steps.
 */
#ifndef MT_COMM_LOCAL_SGD_H
#define MT_COMM_LOCAL_SGD_H

#include "comm/comm.h"

typedef struct mt_trainer mt_trainer;

/* Whether the trainer steps apart from the other ranks (local_sgd_every
 * > 0 on more than one rank; a dry context's planned ranks count). */
bool mti_local_sgd(const mt_trainer *t);
/* At the end of a step (t->steps counted): every local_sgd_every steps, the
 * ranks' weights (masters where there are) become their mean, and the
 * compute copy follows. A collective. */
mt_status mti_local_sgd_after_step(mt_trainer *t, const char *fn);

#endif /* MT_COMM_LOCAL_SGD_H */
