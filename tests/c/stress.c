/* Stress through the C ABI: T threads x N mixed requests (every direction between
 * pinned host, pageable host, device and disk; random block counts and ids; cancels;
 * waits with timeout 0; handles released before completion), then the engine destroyed
 * with requests still in flight. A watchdog fails the run if anything hangs.
 *
 *   stress [threads] [requests-per-thread] [dir]     (defaults: 16 x 300, /tmp)
 * Each thread only touches its own blocks, so any race a sanitizer reports is kvxfer's. */
#define _DEFAULT_SOURCE /* usleep, rand_r */
#include "kvxfer.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { BLOCKS_PER_THREAD = 4, NLAYOUTS = 4 };

static kvx_engine *engine;
static kvx_layout *layouts[NLAYOUTS];
static int requests_per_thread;
static atomic_long outcomes[32];

struct worker {
  int id;
  atomic_long done; /* completion callbacks seen */
  long submitted;
  unsigned seed;
  kvx_request *in_flight[8]; /* submitted, neither waited for nor released */
  int n_in_flight;
};

static void on_complete(void *user, kvx_request *req, kvx_status s) {
  (void)req;
  struct worker *w = user;
  atomic_fetch_add(&outcomes[s < 32 ? s : 31], 1);
  atomic_fetch_add(&w->done, 1);
}

static void die(const char *what, kvx_status s) {
  fprintf(stderr, "stress: %s: %s: %s\n", what, kvx_status_str(s), kvx_last_error());
  exit(1);
}

static void *run(void *arg) {
  struct worker *w = arg;
  for (int i = 0; i < requests_per_thread; i++) {
    /* A released request may still run: wait until its blocks are ours again. */
    while (atomic_load(&w->done) < w->submitted) usleep(50);
    int src = rand_r(&w->seed) % NLAYOUTS, dst = (src + 1 + rand_r(&w->seed) % (NLAYOUTS - 1)) % NLAYOUTS;
    size_t n = 1 + rand_r(&w->seed) % BLOCKS_PER_THREAD;
    uint64_t s_ids[BLOCKS_PER_THREAD], d_ids[BLOCKS_PER_THREAD];
    for (size_t k = 0; k < BLOCKS_PER_THREAD; k++) s_ids[k] = d_ids[k] = (uint64_t)(w->id * BLOCKS_PER_THREAD + k);
    for (size_t k = BLOCKS_PER_THREAD - 1; k > 0; k--) { /* shuffle the destination ids */
      size_t j = rand_r(&w->seed) % (k + 1);
      uint64_t t = d_ids[k]; d_ids[k] = d_ids[j]; d_ids[j] = t;
    }
    kvx_transfer_options o;
    kvx_transfer_options_init(&o);
    o.on_complete = on_complete;
    o.user_data = w;
    if (rand_r(&w->seed) % 3 == 0) { o.layer_begin = 1; o.layer_end = 3; }
    kvx_request *r = NULL;
    kvx_status st = kvx_transfer_submit(engine, layouts[src], s_ids, layouts[dst], d_ids, n, &o, &r);
    if (st == KVX_ERR_BUSY) { i--; usleep(100); continue; }
    if (st != KVX_OK) die("submit", st);
    w->submitted++;
    switch (rand_r(&w->seed) % 5) {
      case 0: /* cancel, then wait */
        if ((st = kvx_request_cancel(r)) != KVX_OK) die("cancel", st);
        st = kvx_request_wait(r, UINT64_MAX);
        if (st != KVX_OK && st != KVX_ERR_CANCELLED) die("wait after cancel", st);
        kvx_request_release(r);
        break;
      case 1: /* poll with timeout 0 until done */
        while ((st = kvx_request_wait(r, 0)) == KVX_ERR_TIMEOUT) usleep(20);
        if (st != KVX_OK) die("wait(0)", st);
        kvx_request_release(r);
        break;
      case 2: /* release before completion: the transfer still completes */
        kvx_request_release(r);
        break;
      default:
        st = kvx_request_wait(r, UINT64_MAX);
        if (st != KVX_OK) die("wait", st);
        if (kvx_request_poll(r) != KVX_OK) die("poll after wait", kvx_request_poll(r));
        kvx_request_release(r);
    }
  }
  /* Leave a few requests in flight, unreleased, for the engine's destroy. */
  for (int k = 0; k < 2; k++) {
    uint64_t ids[1] = {(uint64_t)(w->id * BLOCKS_PER_THREAD + k)};
    while (atomic_load(&w->done) < w->submitted) usleep(50);
    kvx_request *r = NULL;
    kvx_status st = kvx_transfer_submit(engine, layouts[0], ids, layouts[2], ids, 1, NULL, &r);
    if (st == KVX_OK) w->in_flight[w->n_in_flight++] = r;
  }
  return NULL;
}

static void watchdog(int sig) {
  (void)sig;
  static const char msg[] = "stress: WATCHDOG: no progress, something hangs\n";
  (void)!write(2, msg, sizeof msg - 1);
  _exit(3);
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 16;
  requests_per_thread = argc > 2 ? atoi(argv[2]) : 300;
  const char *dir = argc > 3 ? argv[3] : "/tmp";
  if (threads < 1 || threads > 64) threads = 16;
  signal(SIGALRM, watchdog);
  alarm(600);
  kvx_engine_config ec;
  kvx_engine_config_init(&ec);
  ec.device = KVX_DEVICE_EMULATED;
  ec.io_threads = 4;
  ec.bounce_bytes = 1 << 20;
  ec.slot_bytes = 64 << 10;
  ec.max_inflight = 32;
  kvx_status st = kvx_engine_create(&ec, &engine);
  if (st != KVX_OK) die("engine_create", st);
  kvx_layout_config c;
  kvx_layout_config_init(&c);
  c.num_blocks = (uint64_t)threads * BLOCKS_PER_THREAD;
  c.num_layers = 4;
  c.outer_dim = 2;
  c.page_size = 8;
  c.inner_dim = 100; /* 1600-byte regions: nothing aligned */
  c.dtype_bytes = 2;
  char path[512];
  snprintf(path, sizeof path, "%s/kvx-stress-%d.kv", dir, (int)getpid());
  if ((st = kvx_layout_create_host(engine, &c, KVX_HOST_PINNED, &layouts[0])) != KVX_OK) die("pinned", st);
  if ((st = kvx_layout_create_host(engine, &c, 0, &layouts[1])) != KVX_OK) die("pageable", st);
  c.kind = KVX_LAYOUT_LAYER_SEPARATE_OUTER_FIRST;
  if ((st = kvx_layout_create_device(engine, &c, &layouts[2])) != KVX_OK) die("device", st);
  c.kind = KVX_LAYOUT_FULLY_CONTIGUOUS;
  if ((st = kvx_layout_create_disk(engine, &c, path, KVX_DISK_CREATE, &layouts[3])) != KVX_OK) die("disk", st);

  struct worker *w = calloc((size_t)threads, sizeof *w);
  pthread_t *t = calloc((size_t)threads, sizeof *t);
  for (int i = 0; i < threads; i++) {
    w[i].id = i;
    w[i].seed = 12345u + (unsigned)i;
    pthread_create(&t[i], NULL, run, &w[i]);
  }
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  /* Layouts first (requests keep theirs alive), then the engine with work in flight. */
  for (int i = 0; i < NLAYOUTS; i++) kvx_layout_destroy(layouts[i]);
  kvx_engine_destroy(engine);
  long pending = 0;
  for (int i = 0; i < threads; i++)
    for (int k = 0; k < w[i].n_in_flight; k++) {
      kvx_status s = kvx_request_poll(w[i].in_flight[k]);
      if (s != KVX_OK && s != KVX_ERR_CANCELLED) pending++;
      kvx_request_release(w[i].in_flight[k]);
    }
  long total = 0;
  for (int s = 0; s < 32; s++) total += atomic_load(&outcomes[s]);
  printf("stress: %d threads x %d requests: %ld completed (%ld ok, %ld cancelled, %ld other), %ld not ended after destroy\n",
         threads, requests_per_thread, total, atomic_load(&outcomes[KVX_OK]), atomic_load(&outcomes[KVX_ERR_CANCELLED]),
         total - atomic_load(&outcomes[KVX_OK]) - atomic_load(&outcomes[KVX_ERR_CANCELLED]), pending);
  int bad = pending != 0 || atomic_load(&outcomes[KVX_OK]) + atomic_load(&outcomes[KVX_ERR_CANCELLED]) != total;
  free(w);
  free(t);
  printf("%d passed, %d failed\n", bad ? 0 : 1, bad ? 1 : 0);
  return bad;
}
