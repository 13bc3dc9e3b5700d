/*
 * home.h - a parameter's home on this rank (home.c): where its weights
 * are between steps. The trainer decides it at create; the layers below
 * the strategies (the host offload's copies, the update) ask here rather
 * than asking ZeRO-3, which sits above them.
 */
#ifndef MT_HOME_H
#define MT_HOME_H

#include "train/trainer.h"

/* Whether parameter i's weights live as this rank's ZeRO-3 slice (stage
 * 3, a trained parameter), not whole in the model. */
bool mti_home_sliced(const mt_trainer *t, int i);
/* Where element `at` of parameter i's weights (this rank's) is stored: in
 * its ZeRO-3 slice (t->pw, from the slice's first element t->sh[i].lo),
 * else in the model's whole tensor. */
void *mti_home_weights(const mt_trainer *t, int i, size_t at);

#endif /* MT_HOME_H */
