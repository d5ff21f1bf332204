// systemd readiness notification (sd_notify protocol) without linking libsystemd.
//
// Under `Type=notify` systemd sets NOTIFY_SOCKET to a Unix datagram socket; the daemon sends
// "READY=1" once it serves and "STOPPING=1" when it begins draining, so `systemctl start`
// returns only when engines can connect. Outside systemd NOTIFY_SOCKET is unset and these calls
// do nothing.
#ifndef KVCELLAR_SERVER_SD_NOTIFY_H_
#define KVCELLAR_SERVER_SD_NOTIFY_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvcellar::server {

// Sends `state` (newline-separated VAR=value assignments) to $NOTIFY_SOCKET. OK when the
// variable is unset (not under systemd); an error when it is set but the message cannot be sent.
absl::Status SdNotify(absl::string_view state);

}  // namespace kvcellar::server

#endif  // KVCELLAR_SERVER_SD_NOTIFY_H_
