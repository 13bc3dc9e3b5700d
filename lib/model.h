/*
 * model.h - models as the trainer sees them: a list of parameter tensors
 * and the spec of the network.
 */
#ifndef MT_MODEL_H
#define MT_MODEL_H

#include "internal.h"

typedef enum mti_model_kind { MTI_MODEL_MLP = 1 } mti_model_kind;

#define MTI_MAX_PARAMS (2 * MT_MLP_MAX_LAYERS)

struct mt_model {
    mt_context *ctx;
    mti_model_kind kind;
    mt_mlp_spec mlp;
    int n_tensors;                       /* parameter tensors: W0, b0, W1, b1, ... */
    mti_tensor params[MTI_MAX_PARAMS];   /* class PARAM, persistent; fp32, or the 16-bit
                                            compute copy while a mixed-precision trainer
                                            holds the masters */
    mti_tensor master[MTI_MAX_PARAMS];   /* class MASTER, fp32, while such a trainer lives */
    bool has_master;
    size_t n_params;                     /* elements in all of them */
    _Atomic int n_trainers;
};

#endif /* MT_MODEL_H */
