// Scratch buffers the op's paths allocate per call (op_amx.cpp, op_brgemm.cpp): 64-byte
// aligned, so that tile loads and vector stores never split a cache line.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <memory>

namespace whisper_sparse {

struct AlignedFree {
  void operator()(void* pointer) const { std::free(pointer); }
};

template <typename T>
std::unique_ptr<T[], AlignedFree> aligned_buffer(int64_t count) {
  const int64_t bytes = (count * int64_t(sizeof(T)) + 63) / 64 * 64;
  T* pointer = static_cast<T*>(std::aligned_alloc(64, bytes));
  TORCH_CHECK(pointer != nullptr, "the op could not allocate ", bytes, " bytes of scratch");
  return std::unique_ptr<T[], AlignedFree>(pointer);
}

}  // namespace whisper_sparse
