/*
 * cost.c - what a model's units cost to compute, for the planners that
 * weigh them (the recompute plan, pipeline parallel's stages).
 */
#include <string.h>

#include "model/model.h"

/* Forward FLOPs of each unit, per row of a micro-batch of T tokens (a
 * GEMM's 2 m n k; elementwise work counted once per element), and what
 * selective recompute repeats of a block (its LayerNorms, GELU and the
 * attention's forward). Only their ratios matter. */
void mti_unit_costs(const mt_model *m, int T, double *full, double *sel)
{
    memset(full, 0, (size_t)m->n_units * sizeof *full);
    memset(sel, 0, (size_t)m->n_units * sizeof *sel);
    for (int i = 0; i < m->n_layers; i++) {
        const mti_layer *ly = &m->layers[i];
        double in = ly->in, out = ly->out, f = 0, s = 0;
        switch (ly->kind) {
        case MT_LAYER_LINEAR:
        case MT_LAYER_LM_HEAD: f = 2 * in * out; break;
        case MT_LAYER_BLOCK: {
            double C = in, att = 2.0 * T * C; /* causal: half of 4 T C */
            f = 2 * C * 3 * C + 2 * C * C + 2 * 2 * C * 4 * C + att + 30 * C;
            s = att + 30 * C;
            break;
        }
        default: f = 8 * out; break;
        }
        full[ly->unit] += f;
        sel[ly->unit] += ly->kind == MT_LAYER_BLOCK ? s : 0;
    }
}

