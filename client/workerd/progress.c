/* progress.c - one redrawn terminal line. */
#include "workerd/progress.h"

#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"


void progress_init(progress *p, const char *name, int64_t total_steps, int on)
{
    p->on = on < 0 ? isatty(STDOUT_FILENO) : on;
    p->total = total_steps;
    p->t0 = clk_mono_secs();
    p->last_draw = 0;
    p->step0 = -1;
    p->name = name;
}

static void human(double x, char *buf, size_t n)
{
    if (x >= 1e6)
        snprintf(buf, n, "%.1fM", x / 1e6);
    else if (x >= 1e3)
        snprintf(buf, n, "%.1fk", x / 1e3);
    else
        snprintf(buf, n, "%.0f", x);
}

void progress_update(progress *p, int64_t step, double loss, double examples_per_sec)
{
    if (!p->on)
        return;
    double t = clk_mono_secs();
    if (p->step0 < 0) {
        p->step0 = step;
        p->t0 = t;
    }
    if (t - p->last_draw < 0.2 && step < p->total)
        return;
    p->last_draw = t;
    double frac = p->total > 0 ? (double)step / (double)p->total : 0;
    if (frac > 1)
        frac = 1;
    char bar[31];
    int full = (int)(frac * 30);
    for (int i = 0; i < 30; i++)
        bar[i] = i < full ? '#' : '.';
    bar[30] = '\0';
    double rate = (double)(step - p->step0) / (t - p->t0 + 1e-9);
    char eta[32] = "--";
    if (rate > 0 && step < p->total) {
        long s = (long)((double)(p->total - step) / rate);
        snprintf(eta, sizeof(eta), "%ldm%02lds", s / 60, s % 60);
    }
    char ex[16];
    human(examples_per_sec, ex, sizeof(ex));
    printf("\r%s [%s] %lld/%lld  ETA %s  loss %.4f  %s ex/s\033[K", p->name, bar, (long long)step,
           (long long)p->total, eta, loss, ex);
    fflush(stdout);
}

void progress_clear(progress *p)
{
    if (!p->on || p->last_draw == 0)
        return;
    printf("\r\033[K");
    fflush(stdout);
}
