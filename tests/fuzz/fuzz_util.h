// What the fuzz targets share: quiet protobuf, the invariant check that makes a broken invariant a
// crash libFuzzer records, and the check every refused request must pass.
//
// A target is a file <name>_fuzz.cc with LLVMFuzzerTestOneInput; CMakeLists.txt beside this file
// builds it as bin/fuzz_<name>. Each feeds its input to one parser of untrusted bytes exactly as
// the daemon receives them, and then checks what the daemon relies on of an accepted value.
#ifndef KVCELLAR_TESTS_FUZZ_FUZZ_UTIL_H_
#define KVCELLAR_TESTS_FUZZ_FUZZ_UTIL_H_

#include <google/protobuf/stubs/logging.h>

#include <cstdio>
#include <cstdlib>

#include "absl/status/status.h"
#include "server/errors/cache_error.h"

// Aborts with the failed condition: libFuzzer saves the input as a crash.
#define FUZZ_CHECK(cond)                                                           \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                \
    }                                                                              \
  } while (0)

namespace kvcellar::fuzz {

// Status messages go back to the caller as gRPC metadata; 8 KiB is gRPC's default metadata limit
// and a message near it fails the call as RESOURCE_EXHAUSTED (issue #13, defect 7). Far below it:
// messages quote values by a bounded prefix (core/quote.h).
inline constexpr size_t kMaxErrorMessageBytes = 4096;

// Protobuf logs every invalid UTF-8 string it refuses to parse; at thousands of inputs a second
// that is noise, and the parse failure itself is what the target sees.
inline void QuietProtobuf() { google::protobuf::SetLogHandler(nullptr); }

// A request refused by validation: an error (never OK or UNKNOWN) that names the field at fault,
// with a bounded message.
inline void CheckRefusal(const absl::Status& s) {
  FUZZ_CHECK(!s.ok());
  FUZZ_CHECK(s.code() != absl::StatusCode::kUnknown && s.code() != absl::StatusCode::kInternal);
  FUZZ_CHECK(!server::ErrorFieldOf(s).empty());
  FUZZ_CHECK(s.message().size() <= kMaxErrorMessageBytes);
}

}  // namespace kvcellar::fuzz

#endif  // KVCELLAR_TESTS_FUZZ_FUZZ_UTIL_H_
