/*
 * scaler.h - the loss scaler of fp16 training, the semantics of
 * torch.amp.GradScaler (docs/kernels.md):
 *   the loss is multiplied by `scale` before backward; the gradients are
 *   unscaled by 1/scale (fp32: inv = (float)(1.0 / (double)scale)) and
 *   checked; if any is inf or NaN the optimizer step is skipped and
 *   scale *= backoff, tracker = 0; otherwise tracker += 1 and, when it
 *   reaches growth_interval, scale *= growth (kept only if still finite),
 *   tracker = 0. The products are formed in double and stored as fp32, as
 *   torch does. With dynamic == 0 the scale never changes (steps with
 *   non-finite gradients are still skipped).
 */
#ifndef MT_SCALER_H
#define MT_SCALER_H

typedef struct mti_scaler {
    float scale;
    int growth_tracker;
    double growth_factor, backoff_factor;
    int growth_interval;
    int dynamic;
} mti_scaler;

void mti_scaler_init(mti_scaler *s, float init_scale, double growth, double backoff, int interval,
                     int dynamic);
/* After a step's check: found_inf != 0 if a gradient was not finite. */
void mti_scaler_update(mti_scaler *s, int found_inf);
/* 1/scale as the unscale uses it. */
float mti_scaler_inv(const mti_scaler *s);

#endif /* MT_SCALER_H */
