/*
 * scaler.c - dynamic loss scaling (see scaler.h).
 */
#include <math.h>

#include "optim/scaler.h"

void mti_scaler_init(mti_scaler *s, float init_scale, double growth, double backoff, int interval,
                     int dynamic)
{
    s->scale = init_scale;
    s->growth_tracker = 0;
    s->growth_factor = growth;
    s->backoff_factor = backoff;
    s->growth_interval = interval;
    s->dynamic = dynamic;
}

void mti_scaler_update(mti_scaler *s, int found_inf)
{
    if (!s->dynamic) return;
    if (found_inf) {
        s->scale = (float)((double)s->scale * s->backoff_factor);
        s->growth_tracker = 0;
        return;
    }
    int successful = s->growth_tracker + 1;
    if (successful == s->growth_interval) {
        float grown = (float)((double)s->scale * s->growth_factor);
        if (isfinite(grown)) s->scale = grown; /* never grow past fp32 to inf */
        s->growth_tracker = 0;
    } else {
        s->growth_tracker = successful;
    }
}

float mti_scaler_inv(const mti_scaler *s) { return (float)(1.0 / (double)s->scale); }
