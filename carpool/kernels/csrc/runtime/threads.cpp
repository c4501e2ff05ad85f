// Pins torch's intra-op threads one to a CPU each, as vLLM's CPU worker does
// (VLLM_CPU_OMP_THREADS_BIND). An OpenMP thread left free may be migrated onto the core a
// sibling of the same parallel region is running on, and every region then waits for the
// slower of the two; pinned, each keeps its core and its caches.
//
// It runs one at::parallel_for of as many items as torch has threads: each OpenMP thread
// takes exactly one item (ATen's OpenMP backend cuts the range into num_threads chunks) and
// pins itself, so the pool threads every later region reuses are the ones pinned.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

namespace carpool_threads {

std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = static_cast<int64_t>(cpus.size());
  TORCH_CHECK(n == at::get_num_threads(), "bind_threads: ", n, " CPUs for ",
              at::get_num_threads(), " torch threads (give one CPU per thread)");
  for (int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "bind_threads: no CPU ", cpu);
  }
  std::vector<int64_t> thread_ids(n, -1);
  std::vector<int> errors(n, 0);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[i]), &set);
      if (sched_setaffinity(0, sizeof(set), &set) != 0) {  // 0: the calling thread
        errors[i] = errno;
      }
      thread_ids[i] = static_cast<int64_t>(syscall(SYS_gettid));
    }
  });
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(errors[i] == 0, "bind_threads: pinning a thread to CPU ", cpus[i],
                " failed: ", std::strerror(errors[i]));
  }
  return thread_ids;
}

}  // namespace carpool_threads
