/*
 * cli_sample.c - memtrain sample: text from a byte-level GPT trained by
 * memtrain train --model gpt --save, with train's options.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* Text from a trained byte-level GPT: the prompt, then each next byte drawn
 * from the softmax of the logits at the last position (temperature T; 0:
 * the most likely byte), the model seeing the last max_seq bytes. */
static int sample_text(const cli_opts *o, mt_context *ctx, mt_trainer *t, const mt_gpt_spec *g)
{
    const int T = g->max_seq, V = g->vocab;
    size_t plen = o->prompt ? strlen(o->prompt) : 0, cap = plen + (size_t)o->length + 1;
    int32_t *tok = malloc(cap * sizeof *tok);
    float *lg = malloc((size_t)V * sizeof *lg);
    if (!tok || !lg) {
        free(tok), free(lg);
        fprintf(stderr, "%s: out of memory\n", cli_prog);
        return EXIT_FAIL;
    }
    size_t n = 0;
    for (size_t i = 0; i < plen; i++) tok[n++] = (unsigned char)o->prompt[i] % V;
    if (!n) tok[n++] = '\n' % V;
    fwrite(o->prompt ? o->prompt : "", 1, plen, stdout);
    uint64_t r = (uint64_t)o->seed * 0x9E3779B97F4A7C15ull + 1;
    for (long k = 0; k < o->length; k++) {
        size_t from = n > (size_t)T ? n - (size_t)T : 0;
        mt_batch b = {.n = 1, .tokens = tok + from, .seq_len = (int)(n - from)};
        if (mt_trainer_logits(t, &b, lg, (size_t)V)) {
            free(tok), free(lg);
            return cli_lib_fail(ctx, NULL);
        }
        int next = 0;
        if (o->temperature <= 0) {
            for (int j = 1; j < V; j++)
                if (lg[j] > lg[next]) next = j;
        } else {
            double mx = lg[0], sum = 0;
            for (int j = 1; j < V; j++) mx = lg[j] > mx ? lg[j] : mx;
            for (int j = 0; j < V; j++) sum += exp((lg[j] - mx) / o->temperature);
            r ^= r << 13, r ^= r >> 7, r ^= r << 17;
            double u = (double)(r >> 11) / 9007199254740992.0 * sum, acc = 0;
            for (next = 0; next < V - 1; next++) {
                acc += exp((lg[next] - mx) / o->temperature);
                if (acc > u) break;
            }
        }
        tok[n++] = next;
        if (V <= 256) putchar(next);
        else printf(" %d", next);
    }
    printf("\n");
    free(tok), free(lg);
    return 0;
}

int cmd_sample(int argc, char **argv)
{
    cli_opts o;
    bool help;
    static const char head[] =
        "usage: memtrain sample --model gpt --resume FILE [train options] [--prompt TEXT]\n"
        "                       [--length N] [--temperature X]\n"
        "Text from a GPT trained with 'memtrain train --model gpt --save FILE': give\n"
        "the same model, data and training options (or the same --config) as the run;\n"
        "--seed N seeds the draws.\n";
    int rc = cli_parse(CLI_SAMPLE, head, argc, argv, &o, &help);
    if (rc || help) return rc;
    mt_context_config cfg;
    cli_context_config(&o, &cfg);
    mt_context *ctx;
    if (mt_context_create(&cfg, &ctx)) return cli_lib_fail(NULL, NULL);
    cli_gpt g;
    rc = cli_gpt_open(&o, ctx, &g);
    if (!rc) rc = sample_text(&o, ctx, g.trainer, &g.spec);
    cli_gpt_close(&g);
    mt_context_destroy(ctx);
    return rc;
}
