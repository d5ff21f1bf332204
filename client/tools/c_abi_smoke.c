/* kvcellar-c-abi-smoke: a C program (C11, no C++) using libkvcellar-client.so through
 * kvcellar_client_c.h. It registers a SCHEDULER session and matches one prompt.
 *
 *   kvcellar-c-abi-smoke [SOCKET]
 *
 * Prints one JSON line. Exit 0 when every call behaved per the ABI's contract (a daemon that is
 * missing gives a miss, not an error exit); 1 otherwise.
 */
#include <stdio.h>
#include <string.h>

#include "client/kvcellar_client_c.h"

int main(int argc, char** argv) {
  kvc_client_options opts;
  kvc_client_options_init(&opts);
  opts.addr = argc > 1 ? argv[1] : "/nonexistent/kvcellard.sock";
  opts.rpc_timeout_ms = 200;
  opts.register_timeout_ms = 500;
  kvc_client* client = NULL;
  if (kvc_client_connect(&opts, &client) != KVC_OK) {
    fprintf(stderr, "connect: %s\n", kvc_last_error());
    return 1;
  }
  kvc_registration reg;
  memset(&reg, 0, sizeof(reg));
  reg.instance_id = "c-abi-smoke";
  reg.scheduler = 1;
  reg.ns.model_id = "tiny-llm";
  reg.ns.model_revision = "rev1";
  reg.ns.kv_dtype = "bf16";
  reg.ns.page_size = 4;
  reg.ns.layout = KVC_LAYOUT_MHA;
  reg.ns.tp_size = 1;
  kvc_session* session = NULL;
  int rc = kvc_register(client, &reg, &session);
  if (rc != KVC_OK) {
    fprintf(stderr, "register: %d %s\n", rc, kvc_last_error());
    kvc_client_close(client);
    return 1;
  }
  uint32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  uint8_t keys[2 * KVC_KEY_BYTES];
  size_t nkeys = kvc_compute_keys(session, tokens, 10, keys, 2);
  kvc_match_seq seq;
  memset(&seq, 0, sizeof(seq));
  seq.tokens = tokens;
  seq.num_tokens = 10;
  int mrc = kvc_match(session, &seq, 1, NULL, NULL);
  kvc_session_info info;
  kvc_session_info_get(session, &info);
  kvc_client_stats stats;
  kvc_client_stats_get(client, &stats);
  printf(
      "{\"keys\": %zu, \"key0\": \"%02x%02x%02x%02x\", \"match_rc\": %d, \"l2_hit_pages\": %u, "
      "\"total_pages\": %u, \"session_state\": %d, \"degraded_calls\": %llu}\n",
      nkeys, keys[0], keys[1], keys[2], keys[3], mrc, seq.l2_hit_pages, seq.total_pages, info.state,
      (unsigned long long)stats.degraded_calls);
  kvc_session_close(session, 0);
  kvc_client_close(client);
  /* Keys are local and total_pages counts the full pages whatever the daemon did. */
  return nkeys == 2 && seq.total_pages == 2 ? 0 : 1;
}
