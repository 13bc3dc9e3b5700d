/*
 * plan.h - recompute plans (plan.c).
 */
#ifndef MT_PLAN_H
#define MT_PLAN_H

#include "internal.h"

/* The plan of a fixed policy (not MT_RECOMPUTE_BUDGET): units
 * (mt_model_num_units values) and the segment length. */
void mti_plan_of_policy(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                        int *seg_len);
/* With a budget, or MT_RECOMPUTE_BUDGET: the plan, checked against the
 * budget (a fixed policy) or the cheapest that fits (the budget policy);
 * MT_ERR_BUDGET, with the least need and how, when none does. chosen (may
 * be NULL) gets the plan's estimate. */
mt_status mti_plan_budget(const mt_model *m, const mt_trainer_config *c, unsigned char *units,
                          int *seg_len, mt_estimate_report *chosen);
/* The cost model's seconds of a step's communication on the model's
 * context (its world, cfg's tensor_parallel, pipeline_parallel and zero_stage; 0 on one
 * rank): nominal link rates, for comparing layouts (plan.c). */
double mti_comm_seconds(const mt_model *m, const mt_trainer_config *c);
/* A plan in words, for messages. */
void mti_plan_describe(const mt_model *m, const unsigned char *units, int seg_len, char *buf,
                       size_t cap);

#endif /* MT_PLAN_H */
