/*
 * allocator_names.c - the built-in allocators, listed once: the names that
 * configs, the memtrain command and the tests accept come from here.
 */
#include <string.h>

#include "internal.h"

static const mt_allocator_vtable *(*const builtins[])(void) = {
    mt_allocator_caching, mt_allocator_arena, mt_allocator_pool, mt_allocator_checkpoint,
};
#define N_BUILTINS ((int)(sizeof builtins / sizeof builtins[0]))

const mt_allocator_vtable *mt_allocator_builtin(int i)
{
    return i >= 0 && i < N_BUILTINS ? builtins[i]() : NULL;
}

const mt_allocator_vtable *mt_allocator_by_name(const char *name)
{
    if (!name) return NULL;
    for (int i = 0; i < N_BUILTINS; i++)
        if (!strcmp(name, builtins[i]()->name)) return builtins[i]();
    return NULL;
}
