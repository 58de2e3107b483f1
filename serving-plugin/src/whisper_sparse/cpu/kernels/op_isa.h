// The op's run-time dispatch (op_isa.cpp): which kernels this CPU and its OS run, read from the
// CPU's flags at each call, and a cap below them (whisper_sparse_cpu::set_isa; tests and
// benchmarks run the lower kernels with it).
#pragma once

#include <string>

namespace whisper_sparse {

enum Isa : int { kNone = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

// The kernels the op runs: the best this CPU has, at most the cap.
int active_isa();

// active_isa's name: "none", "avx2", "avx512" or "avx512_bf16".
std::string isa();

// Whether the W8A8 kernels (int8_avx512_vnni.cpp) run: the CPU has AVX-512 VNNI and VBMI2, and
// the cap is at avx512 or above.
bool int8_vnni_runs();

// Cap the kernels at `name` (one of isa()'s names the CPU runs), or "auto" to lift the cap.
void set_isa(const std::string& name);

}  // namespace whisper_sparse
