/* libkvcellar-client C ABI: the C++ API (kvcellar_client.h) behind opaque handles and plain C
 * types, for FFI (Python ctypes, Rust, Go) and C engines. libkvcellar-client.so exports exactly
 * these kvc_* symbols.
 *
 * Conventions:
 *   - Every function that can fail returns an int status (KVC_OK = 0); kvc_last_error() gives the
 *     message of the last failure on the calling thread (valid until that thread's next call).
 *   - Data calls (kvc_match, kvc_load, kvc_backup, kvc_wait) always fill their outputs. When the
 *     daemon is down, restarting, slow or refused, outputs are a miss ("0 hits", "not done") and
 *     the status says why (KVC_ERR_UNAVAILABLE, ...): an engine may ignore the status and act on
 *     the outputs alone. No call blocks past its deadline (rpc_timeout_ms; kvc_wait: its timeout
 *     plus rpc_timeout_ms).
 *   - Keys are 32 raw bytes; arrays of keys are N * 32 bytes, concatenated.
 *   - Handles are thread-safe, except that kvc_session_close / kvc_client_close must not race
 *     other calls on the same handle. Close sessions before their client.
 */
#ifndef KVCELLAR_CLIENT_KVCELLAR_CLIENT_C_H_
#define KVCELLAR_CLIENT_KVCELLAR_CLIENT_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVC_EXPORT __attribute__((visibility("default")))
#else
#define KVC_EXPORT
#endif

#define KVC_KEY_BYTES 32

/* Status codes. */
enum {
  KVC_OK = 0,
  KVC_ERR_INVALID_ARGUMENT = 1, /* a bad argument (client- or daemon-side); nothing was done */
  KVC_ERR_UNAVAILABLE = 2,      /* daemon down, restarting, slow, or not registered yet: a miss */
  KVC_ERR_REJECTED = 3,         /* the daemon refused the request (see kvc_last_error): a miss */
  KVC_ERR_REFUSED = 4,          /* the daemon's ns_digest differs: this session never caches */
  KVC_ERR_INTERNAL = 5,
  KVC_ERR_OP_FAILED = 6 /* kvc_wait_load_signal: the Load failed (recompute its pages) */
};

/* Enum values (equal to kvcellar.v1's numbers where the proto has them). */
enum { KVC_LAYOUT_MHA = 0, KVC_LAYOUT_MLA = 1 };
enum { KVC_DEVICE_CUDA = 1, KVC_DEVICE_SIM = 2 };
enum {
  KVC_SESSION_CONNECTING = 0,
  KVC_SESSION_ACTIVE = 1,
  KVC_SESSION_SUSPECT = 2,
  KVC_SESSION_REFUSED = 3,
  KVC_SESSION_CLOSED = 4
};
enum {
  KVC_OP_PENDING = 1,
  KVC_OP_DONE = 2,
  KVC_OP_FAILED = 3,
  KVC_OP_CANCELLED = 4,
  KVC_OP_UNKNOWN = 5
};
/* Page statuses: kvcellar.v1 PageStatus numbers (KVC_PAGE_OK = 1, PENDING = 2, MISS = 3, ...). */
enum { KVC_PAGE_OK = 1, KVC_PAGE_PENDING = 2, KVC_PAGE_MISS = 3, KVC_PAGE_ALREADY_PRESENT = 4 };

typedef struct kvc_client kvc_client;
typedef struct kvc_session kvc_session;
typedef struct kvc_sim_memory kvc_sim_memory;
typedef struct kvc_sim_signals kvc_sim_signals;

typedef struct {
  const char* addr;               /* socket path or HOST:PORT; NULL or "": the default socket */
  uint32_t rpc_timeout_ms;        /* per RPC; 0: 250 */
  uint32_t register_timeout_ms;   /* kvc_register; 0: 2000 */
  uint32_t backoff_min_ms;        /* reconnect backoff; 0: 100 */
  uint32_t backoff_max_ms;        /* 0: 5000 */
  int heartbeat;                  /* run the lease/reconnect thread (kvc_client_options_init: 1) */
  uint32_t heartbeat_interval_ms; /* 0: the daemon's */
  const char* tls_ca_file;        /* TCP only; NULL: plaintext */
  const char* tls_cert_file;
  const char* tls_key_file;
  const char* tls_server_name;
} kvc_client_options;

typedef struct {
  uint64_t rpcs_ok;
  uint64_t rpcs_failed;
  uint64_t rpcs_unavailable;
  uint64_t rpcs_deadline_exceeded;
  uint64_t rpcs_unimplemented;
  uint64_t degraded_calls;
  uint64_t match_calls;
  uint64_t match_pages;
  uint64_t match_l2_hit_pages;
  uint64_t registrations;
  uint64_t reregistrations;
  uint64_t registration_failures;
  uint64_t sessions_lost;
  uint64_t heartbeats_ok;
  uint64_t heartbeats_failed;
  uint64_t ns_digest_mismatches;
  uint64_t ops_failed_session_lost;
  uint64_t uncertain_submissions;
} kvc_client_stats;

/* KV group kinds of a hybrid model (the canonical encoding's numbers, docs/keys.md "Groups"). */
enum { KVC_GROUP_FULL = 0, KVC_GROUP_WINDOW = 1, KVC_GROUP_STATE = 2 };

/* In a hybrid namespace's blocks: this group's object of this page is not moved. */
#define KVC_NO_BLOCK 0xFFFFFFFFu

typedef struct {
  uint32_t kind;          /* KVC_GROUP_* */
  uint32_t window_tokens; /* KVC_GROUP_WINDOW: the window W in tokens; 0 otherwise */
} kvc_kv_group;

typedef struct {
  const char* tenant; /* NULL: "" */
  const char* model_id;
  const char* model_revision;
  const char* kv_dtype;
  uint32_t page_size;
  uint32_t layout; /* KVC_LAYOUT_* */
  uint32_t tp_size;
  int opaque_keys;
  /* The KV groups of a hybrid model, or NULL / 0: a model of one group. A layer names its group
   * in kvc_layer.group; Load and Backup blocks are then num_pages x num_groups, page-major, with
   * KVC_NO_BLOCK for an object not moved. */
  const kvc_kv_group* groups;
  size_t num_groups;
} kvc_namespace;

typedef struct {
  const char* sim_shm_name;       /* SIM */
  const uint8_t* cuda_ipc_handle; /* CUDA: 64 bytes */
  uint64_t offset;
  uint64_t size;
} kvc_region;

typedef struct {
  uint32_t region;
  uint64_t offset;
  uint64_t block_stride;
  uint64_t bytes_per_block;
} kvc_buffer;

typedef struct {
  kvc_buffer k; /* MLA: the latent */
  kvc_buffer v;
  int has_v;      /* 0 for MLA */
  uint32_t group; /* index into kvc_namespace.groups; 0 without groups */
} kvc_layer;

typedef struct {
  const char* instance_id;
  uint32_t rank;
  int scheduler; /* nonzero: a SCHEDULER session (no device, layout or completion) */
  kvc_namespace ns;
  uint32_t device_kind;       /* KVC_DEVICE_* */
  const uint8_t* device_uuid; /* 16 bytes, or NULL */
  const char* device_name;
  const kvc_region* regions;
  size_t num_regions;
  const kvc_layer* layers;
  size_t num_layers;
  uint32_t num_blocks;
  uint32_t num_load_slots;
  uint32_t num_ready_slots;
  const char* sim_signal_shm_name; /* SIM completion channel (KVCSIG01), or NULL */
  uint64_t sim_signal_size;
  const uint8_t* cuda_load_event_handles;  /* CUDA: num_load_slots * num_layers * 64 bytes */
  const uint8_t* cuda_ready_event_handles; /* CUDA: num_ready_slots * 64 bytes */
  int replace_existing;
  const char* engine_name;
  /* A hybrid layout whose groups have block pools of their own (SGLang's host pools): one block
     count per group (num_blocks the largest), or NULL and 0 when all groups share num_blocks.
     Since API revision 5: a program built against an older header must be rebuilt (the library
     reads these two fields of every registration). */
  const uint32_t* group_num_blocks;
  size_t num_group_num_blocks;
} kvc_registration;

typedef struct {
  uint64_t session_id; /* 0 while not registered */
  uint64_t generation;
  uint64_t daemon_epoch;
  uint32_t lease_ms;
  uint32_t heartbeat_interval_ms;
  uint32_t shard_index;
  uint32_t num_shards;
  int is_shard_writer;
  uint64_t page_object_bytes;
  int state; /* KVC_SESSION_* */
  uint8_t ns_digest[KVC_KEY_BYTES];
  uint32_t max_batch_pages; /* the daemon's limits; 0 while not registered */
  uint32_t max_batch_sequences;
  uint32_t num_l3_tiers;
  /* The daemon's KV events carry each page's tokens: pass them in kvc_backup_seq.tokens. */
  int page_tokens;
} kvc_session_info;

/* Names an op across re-registrations. op_id 0: never accepted, or outcome unknown. */
typedef struct {
  uint64_t op_id;
  uint64_t generation;
} kvc_op;

typedef struct {
  /* In: tokens of the whole sequence from position 0, or keys (32 bytes each) of pages
   * num_computed_pages onwards. */
  const uint32_t* tokens;
  size_t num_tokens;
  const uint8_t* keys;
  size_t num_keys;
  uint32_t num_computed_pages;
  /* Out. */
  uint32_t l2_hit_pages;
  uint32_t l3_hit_pages;
  uint32_t total_pages;
  uint64_t pin_id;
} kvc_match_seq;

typedef struct {
  int pin;
  uint32_t pin_lease_ms;
  uint32_t prefetch_policy; /* kvcellar.v1 PrefetchPolicy; 0: daemon default */
  uint32_t prefetch_timeout_ms;
  uint64_t step_id;
  uint32_t l3_lookup_timeout_ms; /* ask the L3 tiers about pages the index does not know */
} kvc_match_options;

typedef struct {
  const uint8_t* keys;    /* num_pages * 32 bytes */
  const uint32_t* blocks; /* num_pages (x num_groups in a hybrid namespace, page-major) */
  size_t num_pages;
  uint64_t pin_id;
  int release_pin;
  /* Out: at submission. */
  uint32_t leading_ok_pages;
  uint8_t* page_status; /* optional, num_pages entries (KVC_PAGE_*) */
} kvc_load_seq;

typedef struct {
  const uint8_t* parent_key; /* 32 bytes, or NULL for page 0 */
  const uint8_t* keys;
  const uint32_t* blocks; /* as kvc_load_seq.blocks */
  size_t num_pages;
  /* Out: at submission. */
  uint32_t leading_ok_pages;
  uint8_t* page_status; /* optional */
  /* In, optional (NULL): the pages' tokens, num_pages * page_size, for the daemon's KV events; sent
   * only when the daemon wants them (api revision 6). In a chained namespace they must hash to
   * `keys`, else the Backup fails INVALID_ARGUMENT. */
  const uint32_t* tokens;
} kvc_backup_seq;

typedef struct {
  int has_ready;
  uint32_t ready_slot;
  uint64_t ready_token;
  uint32_t write_policy; /* kvcellar.v1 WritePolicy; 0: daemon default */
  uint32_t ready_timeout_ms;
} kvc_backup_options;

typedef struct {
  kvc_op op; /* in */
  /* Out. */
  int state; /* KVC_OP_*; PENDING also when the outcome is not known yet */
  uint32_t num_sequences;
  uint32_t* leading_ok_pages; /* optional caller array, leading_ok_cap entries */
  size_t leading_ok_cap;
} kvc_op_status;

KVC_EXPORT const char* kvc_last_error(void);
KVC_EXPORT const char* kvc_version(void);

KVC_EXPORT void kvc_client_options_init(kvc_client_options* options);
KVC_EXPORT int kvc_client_connect(const kvc_client_options* options, kvc_client** out);
KVC_EXPORT void kvc_client_close(kvc_client* client);
KVC_EXPORT int kvc_client_stats_get(kvc_client* client, kvc_client_stats* out);

/* Registers; *out is set (a session in CONNECTING state when the daemon is unreachable) unless
 * the registration is invalid or the daemon rejected it. */
KVC_EXPORT int kvc_register(kvc_client* client, const kvc_registration* registration,
                            kvc_session** out);
/* Unregisters (draining up to drain_timeout_ms) and frees the handle. */
KVC_EXPORT void kvc_session_close(kvc_session* session, uint32_t drain_timeout_ms);
KVC_EXPORT int kvc_session_info_get(kvc_session* session, kvc_session_info* out);
/* KVC_OK once the session is ACTIVE; KVC_ERR_UNAVAILABLE after timeout_ms. */
KVC_EXPORT int kvc_session_wait_active(kvc_session* session, uint32_t timeout_ms);
/* Keys of the full pages of tokens into keys_out (max_keys * 32 bytes); returns how many. */
KVC_EXPORT size_t kvc_compute_keys(kvc_session* session, const uint32_t* tokens, size_t num_tokens,
                                   uint8_t* keys_out, size_t max_keys);

KVC_EXPORT int kvc_match(kvc_session* session, kvc_match_seq* seqs, size_t num_seqs,
                         const kvc_match_options* options, kvc_op* prefetch_op);
/* op_out gets the op; state_out (optional) its state at submission (KVC_OP_*). */
KVC_EXPORT int kvc_load(kvc_session* session, kvc_load_seq* seqs, size_t num_seqs,
                        int signal_layers, uint32_t completion_slot, kvc_op* op_out,
                        int* state_out);
KVC_EXPORT int kvc_backup(kvc_session* session, kvc_backup_seq* seqs, size_t num_seqs,
                          const kvc_backup_options* options, kvc_op* op_out, int* state_out);
KVC_EXPORT int kvc_wait(kvc_session* session, kvc_op_status* ops, size_t num_ops,
                        uint32_t timeout_ms, int any);
/* SIM engines: waits for layer `layer` of the Load `op` (signal_layers on `slot`) to be signalled,
 * or for its op word. KVC_OK when signalled (kvc_wait_load_signal: the Load is DONE);
 * KVC_ERR_OP_FAILED when the Load failed; KVC_ERR_UNAVAILABLE when the op's session ended (the
 * daemon will never signal it) or after timeout_ms. */
KVC_EXPORT int kvc_wait_layer(kvc_session* session, kvc_op op, uint32_t slot, uint32_t layer,
                              uint32_t timeout_ms);
KVC_EXPORT int kvc_wait_load_signal(kvc_session* session, kvc_op op, uint32_t slot,
                                    uint32_t timeout_ms);
KVC_EXPORT int kvc_release(kvc_session* session, const uint64_t* pin_ids, size_t num_pins,
                           const kvc_op* cancel_ops, size_t num_cancel);

/* ---- Keys without a session (docs/keys.md) ------------------------------------------------ */

/* ns_digest of a namespace; KVC_ERR_INVALID_ARGUMENT naming the bad field. */
KVC_EXPORT int kvc_namespace_digest(const kvc_namespace* ns, uint8_t* digest_out);
/* Keys of the full pages of tokens, chained from parent_key (32 bytes; NULL: the namespace's
 * digest, i.e. tokens start at position 0). *num_keys_out = min(full pages, max_keys). */
KVC_EXPORT int kvc_page_keys(const kvc_namespace* ns, const uint8_t* parent_key,
                             const uint32_t* tokens, size_t num_tokens, uint8_t* keys_out,
                             size_t max_keys, size_t* num_keys_out);

/* kvc_page_keys of tokens from position 0 in the session's namespace, through the session's key
 * cache (16 MiB of recent chains, as the C++ client's): a conversation's earlier pages, keyed by an
 * earlier call, are not hashed again, as in the C++ client's Session::Match with token ids. */
KVC_EXPORT int kvc_session_keys(kvc_session* session, const uint32_t* tokens, size_t num_tokens,
                                uint8_t* keys_out, size_t max_keys, size_t* num_keys_out);

/* ---- SIM device: engine memory and the completion channel in POSIX shared memory -------------
 * An engine on the sim device keeps its KV cache in shared-memory objects that the daemon maps by
 * name (the kvc_region's sim_shm_name). These create them; the handle owns the name: closing it
 * unmaps and unlinks the object (a daemon that mapped it keeps its mapping). */

/* A fresh object name, "/kvc-<tag>-<pid>-<n>-<random>", into buf (cap bytes). */
KVC_EXPORT int kvc_sim_unique_name(const char* tag, char* buf, size_t cap);
/* Creates `name` with `bytes` zero bytes, mapped read-write. */
KVC_EXPORT int kvc_sim_memory_create(const char* name, uint64_t bytes, kvc_sim_memory** out);
KVC_EXPORT uint8_t* kvc_sim_memory_data(const kvc_sim_memory* memory);
KVC_EXPORT uint64_t kvc_sim_memory_size(const kvc_sim_memory* memory);
KVC_EXPORT const char* kvc_sim_memory_name(const kvc_sim_memory* memory);
KVC_EXPORT void kvc_sim_memory_close(kvc_sim_memory* memory);

/* Creates the KVCSIG01 signal region to register as sim_signal_shm_name / sim_signal_size. */
KVC_EXPORT int kvc_sim_signals_create(const char* name, uint32_t num_load_slots,
                                      uint32_t num_layers, uint32_t num_ready_slots,
                                      kvc_sim_signals** out);
KVC_EXPORT const char* kvc_sim_signals_name(const kvc_sim_signals* signals);
KVC_EXPORT uint64_t kvc_sim_signals_size(const kvc_sim_signals* signals);
/* The engine's Backup ready signal: the writes of the Backup using ready slot `slot` with this
 * token (strictly increasing per slot, > 0) are done. */
KVC_EXPORT int kvc_sim_signals_publish_ready(kvc_sim_signals* signals, uint32_t slot,
                                             uint64_t token);
KVC_EXPORT void kvc_sim_signals_close(kvc_sim_signals* signals);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KVCELLAR_CLIENT_KVCELLAR_CLIENT_C_H_ */
