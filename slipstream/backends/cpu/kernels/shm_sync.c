// Flags for the tensor-parallel ranks of one machine that exchange tensors through a shared
// mapping (backends/cpu/shm_collectives.py): a rank publishes a call's sequence number after
// writing its slot (a release store), and waits until every rank has published it (acquire
// loads), so the slots it then reads are complete on any memory model.
#include <sched.h>
#include <stdint.h>
#include <time.h>

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

void shm_publish(int64_t *flag, int64_t seq) { __atomic_store_n(flag, seq, __ATOMIC_RELEASE); }

// flags[r * stride] for r < size; 0 once every flag has reached seq, -1 after timeout_ns.
// Spins briefly, then yields the core on every turn: ranks may outnumber cores.
int shm_wait(const int64_t *flags, int32_t stride, int32_t size, int64_t seq, int64_t timeout_ns) {
    int64_t start = 0;
    for (int32_t r = 0; r < size; r++) {
        for (int64_t spins = 0; __atomic_load_n(&flags[(int64_t)r * stride], __ATOMIC_ACQUIRE) < seq; spins++) {
            if (spins < 2000) {
                cpu_relax();
                continue;
            }
            sched_yield();
            if ((spins & 255) == 0) {
                int64_t t = now_ns();
                if (start == 0)
                    start = t;
                else if (t - start > timeout_ns)
                    return -1;
            }
        }
    }
    return 0;
}
