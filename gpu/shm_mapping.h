// ShmMapping: a POSIX shared-memory object mapped into this process.
//
// The sim device keeps engine "device memory" and the completion region in shm objects: the
// engine creates them (Create) and the daemon maps them by name (Open), so both processes see the
// same bytes, exactly as both see one GPU allocation through CUDA IPC.
//
// Trust: a process that truncates an object another process has mapped makes that process's next
// access fault (SIGBUS). The sim device is a stand-in for a GPU on machines without one; it trusts
// the engines that may connect (the socket's permissions decide who can).
#ifndef KVCELLAR_GPU_SHM_MAPPING_H_
#define KVCELLAR_GPU_SHM_MAPPING_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvcellar::gpu {

class ShmMapping {
 public:
  // Creates a new object of `bytes` (zero-filled, mode 0600) and maps all of it read-write. The
  // mapping owns the name: destruction unlinks it. ALREADY_EXISTS when the name is taken.
  static absl::StatusOr<ShmMapping> Create(absl::string_view name, uint64_t bytes);

  // Maps the first `bytes` of an existing object read-write. NOT_FOUND when there is no such
  // object; INVALID_ARGUMENT when it holds fewer than `bytes` bytes. Does not own the name.
  static absl::StatusOr<ShmMapping> Open(absl::string_view name, uint64_t bytes);

  // INVALID_ARGUMENT unless `name` is a portable POSIX shm name: "/" then 1..254 characters, none
  // of them "/".
  static absl::Status CheckName(absl::string_view name);

  ShmMapping() = default;
  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping();

  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }

  // Unmaps (and unlinks, if owner) now.
  void Reset();

 private:
  ShmMapping(std::string name, uint8_t* data, uint64_t size, bool owner)
      : name_(std::move(name)), data_(data), size_(size), owner_(owner) {}

  std::string name_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  bool owner_ = false;
};

}  // namespace kvcellar::gpu

#endif  // KVCELLAR_GPU_SHM_MAPPING_H_
