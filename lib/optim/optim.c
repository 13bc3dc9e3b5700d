/*
 * optim.c - the optimizer table: one entry per mt_optimizer_kind, each
 * defined in its own file (lib/optim_*.c), and what every caller of an
 * optimizer shares (slice alignment, state sizes, names).
 */
#include <string.h>

#include "optim/optim.h"

/* Indexed by mt_optimizer_kind (which starts at 1, without gaps). A new
 * optimizer is a file defining its entry, an enum value in memtrain.h, one
 * line here and its kind in the assertion below (the last kind). */
static const mti_optim *const table[] = {
    [MT_OPT_SGD] = &mti_optim_sgd,
    [MT_OPT_ADAMW] = &mti_optim_adamw,
    [MT_OPT_ADAMW8] = &mti_optim_adamw8,
    [MT_OPT_ADAFACTOR] = &mti_optim_adafactor,
    [MT_OPT_ADAMW4] = &mti_optim_adamw4,
};
#define N_KINDS ((int)(sizeof table / sizeof table[0]))
_Static_assert(N_KINDS == MT_OPT_ADAMW4 + 1, "an entry up to the last mt_optimizer_kind");

const mti_optim *mti_optim_of(mt_optimizer_kind kind)
{
    return (int)kind > 0 && (int)kind < N_KINDS ? table[kind] : NULL;
}

size_t mti_optim_slice_align(const mti_opt_layout *l)
{
    size_t a = 1;
    for (int j = 0; j < MTI_OPT_SLOTS; j++) {
        size_t per = l->s[j].numel && l->s[j].per > 0 ? (size_t)l->s[j].per : 1, x = a, y = per;
        while (y) { size_t r = x % y; x = y, y = r; }
        a = a / x * per;
    }
    return a;
}

int64_t mti_optim_state_numel(const mti_opt_state *s, size_t at, size_t n)
{
    if (!s->numel) return 0;
    if (s->per <= 0) return s->numel;
    const int64_t per = s->per;
    return ((int64_t)(at + n) + per - 1) / per - (int64_t)at / per;
}

const char *mt_optimizer_name(mt_optimizer_kind kind)
{
    const mti_optim *o = mti_optim_of(kind);
    return o ? o->name : NULL;
}

mt_status mt_optimizer_by_name(const char *name, mt_optimizer_kind *out)
{
    if (!name || !out)
        return mti_fail(NULL, MT_ERR_INVALID_ARG, "mt_optimizer_by_name: %s is NULL",
                        name ? "out" : "name");
    char known[256] = "";
    for (int k = 1; k < N_KINDS; k++) {
        if (!table[k]) continue;
        if (!strcmp(name, table[k]->name)) {
            *out = (mt_optimizer_kind)k;
            return MT_OK;
        }
        size_t len = strlen(known);
        snprintf(known + len, sizeof known - len, "%s%s", len ? ", " : "", table[k]->name);
    }
    return mti_fail(NULL, MT_ERR_INVALID_ARG, "unknown optimizer '%s' (%s)", name, known);
}
