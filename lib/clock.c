/*
 * clock.c - the library's clock: nanoseconds of CLOCK_MONOTONIC (traces,
 * file and collective timings). A leaf: it calls nothing of the library.
 */
#include <time.h>

#include "internal.h"

uint64_t mti_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
