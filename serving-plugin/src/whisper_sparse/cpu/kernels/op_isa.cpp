// The op's run-time dispatch from the CPU's flags (op_isa.h).
#include "op_isa.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>

namespace whisper_sparse {
namespace {

const char* const kIsaNames[] = {"none", "avx2", "avx512", "avx512_bf16"};

// The best kernels this CPU and its OS run (libgcc checks that the OS saves the vector state).
int detected_isa() {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return kNone;
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2")))
    return kAvx2;
  return __builtin_cpu_supports("avx512bf16") ? kAvx512Bf16 : kAvx512;
}

std::atomic<int> cap{kAvx512Bf16};

}  // namespace

int active_isa() { return std::min(detected_isa(), cap.load()); }

bool int8_vnni_runs() {
  static const bool present = detected_isa() >= kAvx512 && __builtin_cpu_supports("avx512vnni") &&
                              __builtin_cpu_supports("avx512vbmi");
  return present && cap.load() >= kAvx512;
}

std::string isa() { return kIsaNames[active_isa()]; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    cap = kAvx512Bf16;
    return;
  }
  for (int level = kNone; level <= kAvx512Bf16; ++level) {
    if (name == kIsaNames[level]) {
      TORCH_CHECK(level <= detected_isa(), "set_isa: this CPU has no ", name, " kernels (it runs ",
                  kIsaNames[detected_isa()], ")");
      cap = level;
      return;
    }
  }
  TORCH_CHECK(false, "set_isa: name must be auto, none, avx2, avx512 or avx512_bf16; got ", name);
}

}  // namespace whisper_sparse
