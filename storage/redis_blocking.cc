#include "storage/redis_blocking.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include "absl/strings/str_cat.h"
#include "platform/sigpipe_guard.h"

namespace kvcellar::storage {

void HiredisContextFree::operator()(redisContext* c) const { redisFree(c); }
void HiredisReplyFree::operator()(redisReply* r) const { freeReplyObject(r); }

absl::StatusOr<HiredisContext> ConnectBlocking(const RedisAddress& node, absl::Duration timeout,
                                               const std::string& password) {
  const timeval tv = absl::ToTimeval(std::max(timeout, absl::Milliseconds(1)));
  HiredisContext c(node.is_unix ? redisConnectUnixWithTimeout(node.host.c_str(), tv)
                                : redisConnectWithTimeout(node.host.c_str(), node.port, tv));
  if (c == nullptr) return absl::ResourceExhaustedError("redis context");
  if (c->err != 0) {
    return absl::UnavailableError(absl::StrCat("connect ", node.ToString(), ": ", c->errstr));
  }
  redisSetTimeout(c.get(), tv);
  if (!password.empty()) {
    platform::ScopedSigpipeBlock no_sigpipe;  // hiredis writes with write(2).
    HiredisReply auth(static_cast<redisReply*>(redisCommand(c.get(), "AUTH %s", password.c_str())));
    if (auth == nullptr || auth->type == REDIS_REPLY_ERROR) {
      return absl::PermissionDeniedError(absl::StrCat("AUTH on ", node.ToString()));
    }
  }
  return c;
}

}  // namespace kvcellar::storage
