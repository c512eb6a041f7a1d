// FerryKvWrite: new K or V rows written into the cache pages at their slots.

#pragma once

#include "common.h"

namespace {

// XLA CPU widens a scatter into a bfloat16/float16 array to float32 over the whole operand (a
// convert and a copy of every page, per layer, per step); this writes only the T rows, in place.
ffi::Error KvWriteImpl(ffi::AnyBuffer pages, ffi::AnyBuffer updates, ffi::Buffer<ffi::S32> slots,
                       ffi::Result<ffi::AnyBuffer> out) {
  auto pd = pages.dimensions(), ud = updates.dimensions();
  if (pages.element_type() != updates.element_type() || out->element_type() != pages.element_type())
    return ffi::Error::InvalidArgument("ferry kv write: pages, updates and out must share a dtype");
  const size_t n = pd.size();
  if (n < 4 || ud.size() != 3 || slots.dimensions().size() != 1 || ud[1] != pd[n - 2] ||
      ud[2] != pd[n - 1] || slots.dimensions()[0] != ud[0])
    return ffi::Error::InvalidArgument(
        "ferry kv write: expected pages [..., NB, BS, H, D], updates [T, H, D], slot_mapping [T]");
  int64_t num_slots = 1;  // the rows of the leading dims, in order: [L, NB, BS] is L * NB * BS slots
  for (size_t i = 0; i + 2 < n; ++i) num_slots *= pd[i];
  if (num_slots == 0) return ffi::Error::Success();
  const int64_t row_bytes = static_cast<int64_t>(pages.size_bytes() / num_slots);
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != pages.untyped_data())  // not aliased after all: start from the pages
    std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  const char* src = static_cast<const char*>(updates.untyped_data());
  const int32_t* slot = slots.typed_data();
  for (int64_t t = 0; t < ud[0]; ++t)
    if (slot[t] >= 0 && slot[t] < num_slots)
      std::memcpy(dst + slot[t] * row_bytes, src + t * row_bytes, row_bytes);
  return ffi::Error::Success();
}

}  // namespace
