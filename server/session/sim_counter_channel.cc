#include "server/session/sim_counter_channel.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/quote.h"
#include "server/errors/cache_error.h"
#include "server/session/memory_access.h"

namespace kvcellar::server {
namespace {

absl::Status HandleError(absl::string_view field, absl::string_view message) {
  return CacheError(absl::StatusCode::kFailedPrecondition, v1::ERROR_REASON_HANDLE_OPEN_FAILED,
                    field, message);
}

}  // namespace

absl::StatusOr<std::shared_ptr<SimCounterChannel>> SimCounterChannel::Open(
    absl::string_view name, uint64_t size_bytes, uint32_t num_load_slots, uint32_t num_layers,
    uint32_t num_ready_slots, const platform::EngineMemoryAccess& access) {
  constexpr absl::string_view kNameField = "completion.sim_counters.shm_name";
  constexpr absl::string_view kSizeField = "completion.sim_counters.size_bytes";
  const core::SignalLayout layout(num_load_slots, num_layers, num_ready_slots);
  const uint64_t need = layout.Bytes();
  if (size_bytes < need) {
    return InvalidField(kSizeField,
                        absl::StrCat(kSizeField, " (", size_bytes, ") is below the ", need,
                                     " bytes that ", num_load_slots, " load slots of ", num_layers,
                                     " layers and ", num_ready_slots, " ready slots need"));
  }
  absl::StatusOr<platform::ShmMapping> shm = platform::ShmMapping::Open(name, need, access);
  if (!shm.ok()) {
    return MemoryAccessPolicy::OpenError(
        kNameField, shm.status(),
        absl::StrCat(kNameField, " ", core::Quote(name), ": ", shm.status().message()));
  }
  if (!HasMagic(shm->data())) {
    return HandleError(kNameField, absl::StrCat(kNameField, " ", core::Quote(name),
                                                ": not a KVCSIG01 signal region (bad magic)"));
  }
  const Header header = ReadHeader(shm->data());
  if (header.version != kVersion) {
    return HandleError(kNameField,
                       absl::StrCat(kNameField, " ", core::Quote(name), ": header version ",
                                    header.version, ", expected ", kVersion));
  }
  struct Check {
    absl::string_view field;
    uint32_t have;
    uint32_t want;
  };
  for (const Check& c :
       {Check{"completion.num_load_slots", header.num_load_slots, num_load_slots},
        Check{"layout.layers", header.num_layers, num_layers},
        Check{"completion.num_ready_slots", header.num_ready_slots, num_ready_slots}}) {
    if (c.have != c.want) {
      return HandleError(
          c.field, absl::StrCat(kNameField, " ", core::Quote(name), ": the header says ", c.have,
                                " for ", c.field, ", the registration ", c.want));
    }
  }
  return std::shared_ptr<SimCounterChannel>(new SimCounterChannel(*std::move(shm), layout));
}

}  // namespace kvcellar::server
