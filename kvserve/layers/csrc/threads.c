/* Pinning the calling thread's OpenMP team to CPUs: thread t of the team runs only on cpus[t % n].
 *
 * Why: on a host with as many CPUs as compute threads, the Linux scheduler moves an OpenMP thread that the
 * HTTP thread (or anything else) briefly displaced, and a GEMM split statically over the team waits at its
 * barrier for the moved thread; pinned, each thread keeps its CPU and its caches. Measured on the project's
 * 2-vCPU Zen 5 host, workload A at 64 concurrent requests through the server, paired runs: pinned won 6 of 8
 * pairs, median +9 % tokens/s (docs/performance-log.md). vLLM's CPU backend binds its OpenMP threads the same
 * way (VLLM_CPU_OMP_THREADS_BIND).
 *
 * The calling thread is thread 0 of its team, so it is pinned too (to cpus[0]); threads it creates later
 * inherit that mask. Returns the team size, or -1 where the OS has no per-thread affinity call. */
#define _GNU_SOURCE
#include <stdint.h>
#ifdef __linux__
#include <sched.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

int pin_omp_threads(const int32_t *cpus, int32_t n) {
#if defined(__linux__) && defined(_OPENMP)
    int team = 0, failed = 0;
#pragma omp parallel reduction(+ : failed)
    {
        const int t = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t % n], &set);
        failed += sched_setaffinity(0, sizeof(set), &set) != 0; /* 0: the calling thread (Linux) */
#pragma omp single
        team = omp_get_num_threads();
    }
    return failed ? -1 : team;
#else
    (void)cpus;
    (void)n;
    return -1;
#endif
}
