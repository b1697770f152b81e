// Runs gradcomp's CUDA kernels on the CPU (see cuda_emulation.h for the execution model).
//
// Built by cuda_emulator.py with g++ -std=c++20 into a shared library that exposes
//   gc_emu_launch(name, grid, block, args, kinds, sizes, nargs, error, error_len)
// mirroring cuLaunchKernel: `args[i]` points at the value of argument i. `kinds`/`sizes`
// describe what the host packed ('p' pointer, 'i' integer, 'f' float, and its byte size);
// they are checked against the kernel's C++ signature, so a host that packs a Python float
// where the kernel takes a float32, say, fails here instead of corrupting memory on a GPU.
//
// The build defines GRADCOMP_EMULATION_SOURCES (a header including every csrc/*.cu) and
// GRADCOMP_EMULATION_KERNELS (one GRADCOMP_EMULATED_KERNEL(name) line per extern "C" kernel).
#include "cuda_emulation.h"

#include <barrier>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include GRADCOMP_EMULATION_SOURCES

#ifndef GRADCOMP_MAX_THREADS  // sources that do not include gradcomp_common.cuh (tests of the emulation)
#define GRADCOMP_MAX_THREADS 1024
#endif

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
dim3 blockDim;
dim3 gridDim;

namespace gradcomp_emulation {

struct Site {
  const char* file;
  int line;
  int id;  // unique per __syncthreads in the translation unit
  bool operator==(const Site& other) const { return id == other.id && line == other.line; }
};

// The threads of the block being run: a barrier that also checks call sites.
class Block {
 public:
  explicit Block(unsigned threads) : sites_(threads), barrier_(threads, Check{this}) {}

  void sync(Site site) {
    sites_[threadIdx.x] = site;
    barrier_.arrive_and_wait();
  }

  std::string error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  struct Check {
    Block* block;
    void operator()() noexcept { block->check_sites(); }
  };

  void check_sites() noexcept {  // runs once per phase, after every thread arrived
    for (unsigned t = 1; t < sites_.size(); ++t) {
      if (!(sites_[t] == sites_[0])) {
        char message[512];
        std::snprintf(message, sizeof message,
                      "divergent __syncthreads in block %u: thread 0 at %s:%d, thread %u at %s:%d", blockIdx.x,
                      sites_[0].file, sites_[0].line, t, sites_[t].file, sites_[t].line);
        std::lock_guard<std::mutex> lock(mutex_);
        if (error_.empty()) error_ = message;
        return;
      }
    }
  }

  std::vector<Site> sites_;
  std::barrier<Check> barrier_;
  std::mutex mutex_;
  std::string error_;
};

thread_local Block* current_block = nullptr;

void syncthreads(const char* file, int line, int site) { current_block->sync(Site{file, line, site}); }

// Runs `kernel` on every thread of every block, blocks one after another.
std::string run_grid(unsigned grid, unsigned threads, const std::function<void()>& kernel) {
  gridDim = dim3{grid, 1, 1};
  blockDim = dim3{threads, 1, 1};
  Block block(threads);
  std::vector<std::thread> team;
  team.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    team.emplace_back([&block, &kernel, grid, t] {
      current_block = &block;
      threadIdx = uint3{t, 0, 0};
      for (unsigned b = 0; b < grid; ++b) {
        blockIdx = uint3{b, 0, 0};
        kernel();
        block.sync(Site{"<end of block>", 0, -1});  // nobody starts block b+1 before all left b
      }
    });
  }
  for (std::thread& thread : team) thread.join();
  return block.error();
}

template <class T>
constexpr char kind_of() {
  return std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f' : std::is_integral_v<T> ? 'i' : '?';
}

template <class Kernel>
struct Launcher;

template <class... Args>
struct Launcher<void (*)(Args...)> {
  static std::string check(const char* kinds, const int* sizes, int nargs) {
    const char expected_kinds[] = {kind_of<Args>()..., '\0'};
    const int expected_sizes[] = {(int)sizeof(Args)..., 0};
    if (nargs != (int)sizeof...(Args)) {
      return "the kernel takes " + std::to_string(sizeof...(Args)) + " arguments, the host passed " +
             std::to_string(nargs);
    }
    for (int i = 0; i < nargs; ++i) {
      if (kinds[i] != expected_kinds[i] || sizes[i] != expected_sizes[i]) {
        return "argument " + std::to_string(i) + ": the kernel takes kind '" + expected_kinds[i] + "' of " +
               std::to_string(expected_sizes[i]) + " bytes, the host passed kind '" + kinds[i] + "' of " +
               std::to_string(sizes[i]) + " bytes";
      }
    }
    return "";
  }

  template <std::size_t... I>
  static std::function<void()> bind(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
    return [kernel, values = std::make_tuple(*static_cast<std::remove_reference_t<Args>*>(args[I])...)] {
      kernel(std::get<I>(values)...);
    };
  }

  static std::string launch(void (*kernel)(Args...), unsigned grid, unsigned threads, void** args,
                            const char* kinds, const int* sizes, int nargs) {
    std::string error = check(kinds, sizes, nargs);
    if (!error.empty()) return error;
    return run_grid(grid, threads, bind(kernel, args, std::index_sequence_for<Args...>{}));
  }
};

struct Kernel {
  const char* name;
  std::string (*launch)(unsigned, unsigned, void**, const char*, const int*, int);
};

#define GRADCOMP_EMULATED_KERNEL(NAME)                                                                   \
  Kernel{#NAME, [](unsigned grid, unsigned threads, void** args, const char* kinds, const int* sizes,  \
                   int nargs) { return Launcher<decltype(&NAME)>::launch(&NAME, grid, threads, args, kinds, sizes, nargs); }},

const Kernel kernels[] = {
#include GRADCOMP_EMULATION_KERNELS
};

}  // namespace gradcomp_emulation

using namespace gradcomp_emulation;

extern "C" {

int gc_emu_kernel_count() { return (int)(sizeof kernels / sizeof kernels[0]); }

const char* gc_emu_kernel_name(int i) { return kernels[i].name; }

int gc_emu_max_threads() { return GRADCOMP_MAX_THREADS; }

// Returns 0 on success; otherwise writes a message into `error` and returns non-zero.
int gc_emu_launch(const char* name, unsigned grid, unsigned threads, void** args, const char* kinds,
                  const int* sizes, int nargs, char* error, int error_len) {
  std::string message;
  const Kernel* found = nullptr;
  for (const Kernel& kernel : kernels) {
    if (std::strcmp(kernel.name, name) == 0) found = &kernel;
  }
  if (found == nullptr) {
    message = std::string("no kernel named ") + name + " in csrc/";
  } else if (grid == 0 || threads == 0) {
    message = "empty launch: grid and block must be positive (CUDA rejects them)";
  } else if (threads > GRADCOMP_MAX_THREADS) {
    message = "block of " + std::to_string(threads) + " threads exceeds GRADCOMP_MAX_THREADS=" +
              std::to_string(GRADCOMP_MAX_THREADS);
  } else {
    message = found->launch(grid, threads, args, kinds, sizes, nargs);
  }
  if (message.empty()) return 0;
  std::snprintf(error, (size_t)error_len, "%s: %s", name, message.c_str());
  return 1;
}

}  // extern "C"
