// The bitmask-byte shuffle controls both AVX2 files read (avx2.cpp's 2:4 rows, avx2_bitmask.cpp's
// unstructured ones): for byte b of a row's bitmask, its j-th marked input takes the row's j-th
// next kept bfloat16 value; 0x80 writes a zero byte. A 2:4 byte marks at most four inputs, so
// it reads the first of these entries' eight values only. Plain C++: no instruction set.
#pragma once

#include <cstdint>
#include <cstring>

namespace whisper_sparse {

struct ByteShuffles {
  // vpshufb over sixteen bytes of kept values broadcast to both halves of a register: kept
  // value j into the high half of its input's float32 lane (the float32 it is)
  alignas(64) uint8_t widen[256][32];
  // pshufb: kept value j into its input's bfloat16 lane (a dense row of eight)
  alignas(64) uint8_t place[256][16];

  ByteShuffles() {
    std::memset(this, 0x80, sizeof(*this));
    for (int byte = 0; byte < 256; ++byte) {
      int before = 0;
      for (int i = 0; i < 8; ++i) {
        if (!(byte >> i & 1)) continue;
        const int lane = 4 * (i % 4) + (i / 4) * 16;  // byte offset in the 256-bit register
        widen[byte][lane + 2] = place[byte][2 * i] = uint8_t(2 * before);
        widen[byte][lane + 3] = place[byte][2 * i + 1] = uint8_t(2 * before + 1);
        ++before;
      }
    }
  }
};

inline const ByteShuffles kByteShuffles;

}  // namespace whisper_sparse
